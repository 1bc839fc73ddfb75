"""Huginn's per-token adaptive depth in both frameworks' decode (`decode_step(adaptive=)`: the
released KL exit criterion, rows that exited riding along held, later iterations reading the
exit iteration's K/V) against the numpy reference's tokens and exit depths, alone and with
WISE; a threshold no KL reaches is fixed depth bitwise; torch's regrouped rows (only the rows
still running run the later iterations) give the ride-along logits and depths bitwise. CPU,
fp32, the reference kernels."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from huginn_cases import (NEW_TOKENS, PROMPT_LENS, SEED, STEPS, TINY, WISE, bound, checkpoint, prompts,
                          reference_generate)
from parity.huginn import jax_generate, torch_generate
from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.huginn_reference import huginn_weights

ADAPTIVE = AdaptiveDepth(threshold=0.45)
"""Among the KLs of this random model's successive iterations (about 0.3 to 0.7): rows exit
after 2, 3 or all 4 iterations."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("huginn-adaptive"))


# The JAX cases run in a process of their own (`test_jax_cases_in_their_own_process`): inside a
# whole-suite process, XLA's CPU compiler (jax 0.10.2) crashed (segmentation fault, then abort)
# compiling this module's third adaptive decode step, after every earlier test had passed; alone,
# the same cases pass. The cause is not known.
FRAMEWORKS = ["jax"] if os.environ.get("WISE_HUGINN_ADAPTIVE_JAX") == "1" else ["torch"]


def test_jax_cases_in_their_own_process():
    if FRAMEWORKS == ["jax"]:
        pytest.skip("this is the JAX process")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                          cwd=root, env=dict(os.environ, WISE_HUGINN_ADAPTIVE_JAX="1"), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the jax cases: two of one test, one of the other; this test and the torch-only regroup test skipped
    assert "3 passed, 2 skipped" in done.stdout, done.stdout[-1000:]


@pytest.fixture(scope="module", params=FRAMEWORKS)
def generate(request, ckpt):
    """generate(wise_config, adaptive) -> (tokens, logits, depths) of the framework's decode."""
    if request.param == "torch":
        from wise_torch.huginn import huginn_from_tensors
        model = huginn_from_tensors(TINY, ckpt.tensors)
        run = lambda straight, **kw: torch_generate(model, prompts(), **kw)  # noqa: E731
    else:
        from wise_jax.huginn import huginn_from_tensors
        params = huginn_from_tensors(TINY, ckpt.tensors)
        run = lambda straight, **kw: jax_generate(params, TINY, prompts(), scan_loops=not straight, **kw)  # noqa: E731

    def generate(wise_config=None, adaptive=ADAPTIVE, straight=False):
        """straight: JAX's iterations straight-line without adaptive depth too (as with it)."""
        depths = [[] for _ in prompts()]
        tokens, logits, _ = run(straight, max_new_tokens=NEW_TOKENS, num_steps=STEPS, seed=SEED,
                                wise_config=wise_config, adaptive=adaptive, depths=None if adaptive is None else depths)
        return tokens, logits, depths
    return generate


@pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])
def test_adaptive_generation_equals_the_reference(generate, ckpt, wise_config):
    """Both prompts decode in one batch, exiting at different iterations; tokens and exit depths
    equal the float64 spec's, whose later tokens read the exited positions' held K/V."""
    weights = huginn_weights(TINY, ckpt.tensors)
    tokens, _, depths = generate(wise_config)
    for prompt, got, ran in zip(prompts(), tokens, depths):
        want_depths = []
        assert got == reference_generate(TINY, weights, prompt, wise_config, ADAPTIVE, want_depths)
        assert ran == want_depths[:NEW_TOKENS - 1]
    flat = [d for row in depths for d in row]
    assert min(flat) < STEPS and len(set(flat)) > 1, depths          # exits happen, at different depths


def test_unreachable_threshold_is_fixed_depth_bitwise(generate):
    """threshold 0: no KL is below it, so every row runs every iteration: fixed depth's logits
    (JAX's fixed depth straight-line, as adaptive depth's iterations are: a scan body may be
    fused otherwise)."""
    tokens, logits, depths = generate(adaptive=AdaptiveDepth(threshold=0.0))
    fixed_tokens, fixed_logits, _ = generate(adaptive=None, straight=True)
    assert tokens == fixed_tokens and all(d == STEPS for row in depths for d in row)
    for got, want in zip(logits, fixed_logits):
        np.testing.assert_array_equal(got, want)


def test_regrouped_rows_give_the_ride_along_tokens_and_depths_and_need_adaptive_without_wise(ckpt):
    """decode_step(regroup=True) gathers the rows still running after each checked iteration:
    the same tokens and depths as riding along, with rows leaving the group while others go
    on, and the logits within fp32 rounding (not bitwise: on CPU a linear layer of one row runs
    another BLAS kernel than one of several rows, so a row's sums round differently once its
    group holds it alone). regroup without adaptive depth, or with WISE, is refused."""
    if FRAMEWORKS != ["torch"]:
        pytest.skip("regrouping is wise_torch's (eager only)")
    from wise_torch.huginn import huginn_from_tensors
    model = huginn_from_tensors(TINY, ckpt.tensors)
    runs = {}
    for regroup in (False, True):
        depths = [[] for _ in prompts()]
        tokens, logits, _ = torch_generate(model, prompts(), max_new_tokens=NEW_TOKENS, num_steps=STEPS, seed=SEED,
                                           adaptive=ADAPTIVE, depths=depths, regroup=regroup)
        runs[regroup] = tokens, logits, depths
    (tokens, ride, depths), (regrouped_tokens, regrouped, regrouped_depths) = runs[False], runs[True]
    assert regrouped_tokens == tokens and regrouped_depths == depths
    assert any(a != b for a, b in zip(*depths)), depths    # a step whose rows exit at different depths
    for got, want in zip(regrouped, ride):
        # Two fp32 runs of the same arithmetic summed in other orders: `bound` (rounding.network_bound
        # over the network's sublayers and its widest reduction: hidden, intermediate or <= 85 keys).
        np.testing.assert_allclose(got, want, rtol=0, atol=bound(TINY, STEPS, want, max(PROMPT_LENS) + NEW_TOKENS))
    for refused in (dict(adaptive=None), dict(adaptive=ADAPTIVE, wise_config=WISE)):
        with pytest.raises(ValueError, match=r"regroup runs adaptive depth \(adaptive=\) without WISE"):
            torch_generate(model, prompts(), max_new_tokens=2, num_steps=STEPS, regroup=True, **refused)
