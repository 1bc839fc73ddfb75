"""The parity suite on this machine (quick shapes): every registered check passes, and every
kernel the frameworks list is importable, hence checked.

Each check is one implementation (parity.checks) shared with `python -m parity`; its bounds are
stated there (bitwise checks: 0 differing values)."""

import dataclasses

import numpy as np
import pytest

from parity import cases
from parity import suite as suite_module
from parity.checks import CHECKS, compare_runs
from parity.suite import EndToEnd, Generated, Settings, Suite
from wise_core.checkpoint import DEFAULT_MODEL
from wise_core.presets import PRESETS


@pytest.fixture(scope="module")
def suite():
    return Suite(quick=True)


def test_every_listed_kernel_is_checked(suite):
    assert not suite.unavailable, f"kernels left out of the parity checks: {suite.unavailable}"
    assert {i.name for i in suite.impls} >= {"torch-reference", "torch-triton", "jax-reference", "jax-pallas"}


def assert_check_passes(suite, name):
    """Run check `name`: it yields results and every row passes (a skipped row is no pass: the
    skips are counted and named in the failure)."""
    results = CHECKS[name].run(suite)
    assert results, f"check {name} produced no results"
    failed = [r for r in results if r.passed is not True]
    assert not failed, f"{len(failed)} of {len(results)} rows of {name} did not pass " \
        f"({sum(r.passed is None for r in failed)} skipped):\n" + "\n".join(
            f"{r.status} {r.impl} {r.case} {r.dtype}: measured {r.measured}, bound {r.bound} ({r.unit}): {r.detail}"
            for r in failed)


@pytest.mark.parametrize("name", list(CHECKS))
def test_check(suite, name):
    assert_check_passes(suite, name)


@pytest.mark.parametrize("rows, outcome", [((True, True), None), ((True, False), "1 of 2 rows"),
                                           ((True, None), r"1 of 2 rows .* \(1 skipped\)")])
def test_one_failed_or_skipped_row_fails_the_check(monkeypatch, rows, outcome):
    """A check passes only when all its rows pass (it used to pass when one did)."""
    from parity.checks import Check, Measured, Task
    tasks = [Task("impl", f"case {i}", "float32", lambda p=passed: Measured(p)) for i, passed in enumerate(rows)]
    monkeypatch.setitem(CHECKS, "planted", Check("planted", "", lambda suite: tasks))
    if outcome is None:
        assert_check_passes(None, "planted")
    else:
        with pytest.raises(AssertionError, match=outcome):
            assert_check_passes(None, "planted")


def test_end_to_end_teacher_forced_bfloat16():
    """The low-precision end-to-end path (run on the GPU at full size) on a tiny model."""
    run = EndToEnd("test-tiny-gqa", "reference", "reference", "wise", "bfloat16", cases.Workload((70,), 4))
    suite = Suite(dataclasses.replace(Settings.for_machine(quick=True), e2e=(run,)), impls=[])
    [result] = CHECKS["end-to-end"].run(suite)
    assert (result.passed, result.case, result.dtype) == (True, "test-tiny-gqa wise forced", "bfloat16"), result.detail
    assert result.measured <= result.bound and result.detail.startswith("4 forced tokens")


@pytest.mark.parametrize("gap, passed", [(1e-6, True), (0.5, False)])
def test_greedy_divergence_passes_only_on_a_near_tie(gap, passed):
    logits = np.zeros((3, 5), np.float32)
    logits[:, 0] = 1.0
    logits[1, 2] = 1.0 - gap  # step 1: token 0 leads token 2 by `gap`
    torch_run, jax_run = Generated([[0, 0, 0]], [logits]), Generated([[0, 2, 4]], [logits.copy()])
    result = compare_runs(PRESETS["test-tiny"], torch_run, jax_run, "float32", forced=False)
    assert result.passed is passed and result.measured == 0
    assert result.detail.startswith("prompt 0 diverges at step 1: torch [0] vs jax [2], torch's top-2 logit gap")
    assert result.detail.endswith("<= 2 x bound: a near-tie" if passed else "NOT a near-tie")


@pytest.mark.parametrize("quick", [True, False])
def test_settings_on_a_gpu(monkeypatch, quick):
    """What an H200 run covers (built here with JAX's backend reported as a GPU; nothing runs)."""
    monkeypatch.setattr(suite_module, "jax_backend", lambda: "gpu")
    s = Settings.for_machine(quick, device="cuda")
    assert {r.kernels for r in s.e2e} == {"torch-reference|jax-reference", "torch-triton|jax-pallas"}
    assert {(r.mode, r.dtype) for r in s.e2e} >= {("dense", "float32"), ("wise", "float32")}
    if not quick:
        assert ("wise", "bfloat16") in {(r.mode, r.dtype) for r in s.e2e}
        assert s.models == ("medium-random", DEFAULT_MODEL) and s.equivalence_model == "medium-random"
        # the all-blocks check and the dense end-to-end runs share generations
        assert all(r.workload == s.equivalence_workload for r in s.e2e if r.model == "medium-random")
        assert max(max(c.seq_lens) for c in s.attention_cases) == 4096
        assert {(c.heads, c.kv_heads, c.head_dim) for c in s.attention_cases} >= {(16, 16, 128), (16, 4, 128)}
    monkeypatch.setattr(suite_module, "jax_backend", lambda: "cpu")
    with pytest.raises(RuntimeError, match="torch runs on CUDA but JAX on 'cpu'"):
        Settings.for_machine(quick, device="cuda")
