"""wise_core.decode_contract: the one check of decode-attention inputs (numpy, no framework)."""

import numpy as np
import pytest

from wise_core import decode_contract as C
from wise_core import modes as M


@pytest.mark.parametrize("block_size, page_size, eta, message", [
    (0, 64, 0.9, r"block_size must be a positive power of two \(an int\), got 0"),
    (48, 64, 0.9, "block_size must be a positive power of two"),
    (np.int64(32), 64, 0.9, r"block_size must be a positive power of two \(an int\), got np.int64\(32\)"),
    (32.0, 64, 0.9, r"got 32.0"),
    (True, 64, 0.9, r"got True"),
    (64, 32, 0.9, "page_size 32 is not a multiple of block_size 64$"),
    (32, 64, 0.0, r"eta must be a number in \(0, 1\], got 0.0"),
    (32, 64, float("nan"), r"eta must be a number in \(0, 1\], got nan"),
    (32, 64, "0.9", r"got '0.9'"),
])
def test_settings_name_the_problem(block_size, page_size, eta, message):
    with pytest.raises(ValueError, match=message):
        C.check_settings(block_size, page_size, eta)


def test_valid_settings_pass():
    C.check_settings(32, 64, 0.95)
    C.check_settings(16, 16, np.float32(1.0))


def test_values_report_every_offending_row():
    table = np.array([[0, 1], [2, -1], [3, 9]], np.int32)
    lens = np.array([64, 33, 32], np.int32)  # row 1 uses 2 pages (-1 is used), row 2 one page
    support = np.zeros((3, 2, 4), bool)
    modes = np.array([M.DENSE, M.DENSE, M.DENSE], np.int32)
    with pytest.raises(ValueError, match=r"page_table: rows \[1\] use pages \[-1\] outside the pool \[0, 4\)"):
        C.check_values(table, lens, modes, support, num_pages=4, page_size=32, block_size=32)
    lens[1] = 32  # now row 1 uses one page only: the -1 past it is ignored
    C.check_values(table, lens, modes, support, num_pages=4, page_size=32, block_size=32)
    modes[2] = M.SPARSE
    support[2, 0, 1] = True  # head 0: block 1 starts at key 32 = seq_len: not causal
    with pytest.raises(ValueError, match=r"SPARSE rows \[2\] select no causal block \(row, head\): \[\(2, 0\), \(2, 1\)\]"):
        C.check_values(table, lens, modes, support, num_pages=4, page_size=32, block_size=32)


def test_reuse_calls_take_sparse_and_dense_rows_only():
    """A reuse loop's call (reuse=True): every row SPARSE or DENSE; the rows that discover are
    named with their modes. The same modes pass a plain call."""
    table = np.zeros((4, 1), np.int32)
    lens = np.full(4, 32, np.int32)
    support = np.ones((4, 2, 1), bool)
    modes = np.array([M.SPARSE, M.DISCOVER, M.DENSE, M.DISCOVER_UNION], np.int32)
    kw = dict(num_pages=1, page_size=32, block_size=32)
    C.check_values(table, lens, modes, support, **kw)
    with pytest.raises(ValueError, match=r"modes of a reuse call must be SPARSE or DENSE: rows \[1, 3\] "
                                         r"hold \['discover', 'discover-union'\]"):
        C.check_values(table, lens, modes, support, reuse=True, **kw)
    C.check_values(table, lens, np.array([M.SPARSE, M.DENSE] * 2, np.int32), support, reuse=True, **kw)
