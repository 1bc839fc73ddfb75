"""The parity suite on this machine (quick shapes): every registered check passes, and every
kernel the frameworks list is importable, hence checked.

Each check is one implementation (parity.checks) shared with `python -m parity`; its bounds are
stated there (bitwise checks: 0 differing values)."""

import pytest

from parity.checks import CHECKS
from parity.suite import Suite


@pytest.fixture(scope="module")
def suite():
    return Suite(quick=True)


def test_every_listed_kernel_is_checked(suite):
    assert not suite.unavailable, f"kernels left out of the parity checks: {suite.unavailable}"
    assert {i.name for i in suite.impls} >= {"torch-reference", "torch-triton", "jax-reference", "jax-pallas"}


@pytest.mark.parametrize("name", list(CHECKS))
def test_check(suite, name):
    results = CHECKS[name].run(suite)
    assert results, f"check {name} produced no results"
    failed = [r for r in results if r.passed is False]
    assert not failed, "\n".join(f"{r.impl} {r.case} {r.dtype}: measured {r.measured} > bound {r.bound} "
                                 f"({r.unit}): {r.detail}" for r in failed)
    assert any(r.passed for r in results), f"check {name} skipped every row: {results[0].detail}"
