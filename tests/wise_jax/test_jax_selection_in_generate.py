"""Inside wise_jax.generate, every discovery call's selected support is
wise_core.reference.select_blocks of the masses that very call computed (DISCOVER), OR-ed into
the held support (DISCOVER_UNION), except where the spec allows rounding to decide
(`rounding.selection_margin`). The all-blocks equivalence cannot see this: there the WISE state
replaces the kernel's selection with the causal blocks.

The decode-attention dispatcher (`wise_jax.attention.attention_impl`) is wrapped to ask each call
for its mass and to send (modes, held support, support', mass) to the host. On CPU: the jnp
reference and the Pallas kernel (interpreted) on a tiny model; on a GPU (`gpu`): the built-in
model in float32 and bfloat16."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest

import wise_jax
from parity.checks import support_differences
from wise_core import modes as M
from wise_core import reference as ref
from wise_core.checkpoint import DEFAULT_MODEL, random_tensors
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_jax import attention


@contextlib.contextmanager
def recorded_discoveries():
    """Yields a list that fills with one (modes, held, support', mass) per decode-attention call
    of the programs traced inside the block (compiled programs are dropped before and after, so
    that the wrapper is traced in and does not outlive the block), and a set of the kernels
    (resolved names) those calls ran."""
    calls, kernels = [], set()
    real = attention.attention_impl

    def wrapped_impl(kernel, head_dim=None):
        impl = real(kernel, head_dim)
        kernels.add(attention.resolve_kernel(kernel, head_dim))

        def call(*args, return_mass=False, **kwargs):
            out, support, mass = impl(*args, return_mass=True, **kwargs)
            jax.debug.callback(lambda *xs: calls.append(tuple(np.asarray(x) for x in xs)),
                               args[5], args[6], support, mass)
            return (out, support, mass) if return_mass else (out, support)
        return call

    jax.clear_caches()
    attention.attention_impl = wrapped_impl
    try:
        yield calls, kernels
    finally:
        attention.attention_impl = real
        jax.clear_caches()


def check_selections(calls, eta: float) -> tuple[int, int]:
    """Assert the rule on every discovery row; returns (discovery rows, rows selecting a strict
    subset of their blocks with mass)."""
    rows = strict = 0
    for modes, held, support, mass in calls:
        for b in np.flatnonzero(np.isin(modes, [M.DISCOVER, M.DISCOVER_UNION])):
            want = ref.select_blocks(mass[b], eta)
            if modes[b] == M.DISCOVER_UNION:
                want = want | held[b]
            got = support[b]
            found = support_differences(mass[b], eta, got, want)
            assert all(d.explained for d in found), "; ".join(d.describe() for d in found if not d.explained)
            rows += 1
            strict += int((ref.select_blocks(mass[b], eta) < (mass[b] > 0)).any())
    return rows, strict


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(vocab, 256), n).tolist() for n in lengths]


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
def test_generate_selects_by_the_rule_on_cpu(kernel):
    """test-tiny (2 layers, 4 loops): 3 prompts of 70-100 keys (3-4 blocks), 3 decode steps."""
    config = PRESETS["test-tiny"]
    params = wise_jax.from_checkpoint_tensors(config, random_tensors(config, seed=4, std=0.08))
    wise = WiseConfig(eta=0.5)
    with recorded_discoveries() as (calls, kernels):
        out = wise_jax.generate(params, config, _prompts(config.vocab_size, (70, 100, 90)), max_new_tokens=4,
                                page_size=32, wise_config=wise, eos_token_id=None, attention_backend=kernel)
    assert kernels == {kernel} and out.stats.fallbacks == 0
    rows, strict = check_selections(calls, wise.eta)
    # 3 decode steps x 2 layers x 2 discovery loops, 4 rows (the batch bucket) each
    assert rows == 3 * 2 * 2 * 4 and strict > rows // 4, (rows, strict)


def _jax_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _jax_gpu(), reason="needs a CUDA GPU for jax")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["pallas", "reference"])
def test_generate_selects_by_the_rule_on_gpu(kernel, dtype):
    """The built-in model, 4 prompts of 300-1900 keys, 8 decode steps, eta 0.9."""
    config, params = wise_jax.load_model(DEFAULT_MODEL, dtype=dtype)
    wise = WiseConfig(eta=0.9)
    lengths = (300, 1100, 1900, 640)
    with recorded_discoveries() as (calls, kernels):
        out = wise_jax.generate(params, config, _prompts(config.vocab_size, lengths, seed=1), max_new_tokens=9,
                                wise_config=wise, eos_token_id=None, attention_backend=kernel)
    assert kernels == {kernel} and out.stats.fallbacks == 0
    rows, strict = check_selections(calls, wise.eta)
    planes = config.num_hidden_layers * len(wise.discover_depths)
    assert rows == 8 * planes * len(lengths) and strict > rows // 4, (rows, strict)
