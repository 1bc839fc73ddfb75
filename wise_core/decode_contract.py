"""The decode-attention contract of docs/DESIGN.md, checked once for every implementation.

`check_inputs` checks shapes, dtypes and settings (no array is read: cheap, no device sync);
`check_values` checks what only the values tell (numpy arrays): seq_lens, modes, the page-table
entries a row uses, and that every SPARSE head selects a causal block. The torch and JAX
references, the Triton and the Pallas kernel call both at their public entry
(`decode_attention(..., validate=True)`, the default); `validate=False` skips `check_values`,
for callers that build these inputs by construction (an engine's hot path). Each raises
ValueError naming the argument and, for values, the rows.

Dtypes are named as numpy names them ("float32", "bfloat16", "int32", "bool").
"""

from __future__ import annotations

import numbers

import numpy as np

from wise_core import modes as M

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
ARGUMENTS = ("q", "k_pages", "v_pages", "page_table", "seq_lens", "modes", "support")


def check_settings(block_size, page_size: int, eta) -> None:
    """block_size a positive power of two (a Python int) dividing page_size; eta a number in (0, 1]."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0 \
            or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two (an int), got {block_size!r}")
    if page_size % block_size:
        raise ValueError(f"page_size {page_size} is not a multiple of block_size {block_size}")
    if not isinstance(eta, numbers.Real) or isinstance(eta, bool) or not 0.0 < eta <= 1.0:
        raise ValueError(f"eta must be a number in (0, 1], got {eta!r}")


def check_inputs(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str], *, block_size, eta) -> None:
    """Shapes and dtypes of the seven arrays (keys: `ARGUMENTS`), and the settings.

    q [batch, heads, head_dim]; k_pages, v_pages [num_pages, page_size, kv_heads, head_dim], one
    floating dtype shared with q; page_table int32[batch, max_pages]; seq_lens, modes
    int32[batch]; support bool[batch, heads, max_pages * page_size // block_size]."""
    q, k, v = shapes["q"], shapes["k_pages"], shapes["v_pages"]
    if len(q) != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got shape {q}")
    if len(k) != 4:
        raise ValueError(f"k_pages must be [num_pages, page_size, kv_heads, head_dim], got shape {k}")
    if v != k:
        raise ValueError(f"v_pages must have k_pages' shape {k}, got {v}")
    batch, heads, head_dim = q
    _, page_size, kv_heads, kv_dim = k
    if kv_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of the KV pages ({kv_dim}) differ")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if dtypes["q"] not in FLOAT_DTYPES or dtypes["k_pages"] != dtypes["q"] or dtypes["v_pages"] != dtypes["q"]:
        raise ValueError(f"q, k_pages and v_pages must share one dtype of {FLOAT_DTYPES}, got "
                         f"{dtypes['q']}, {dtypes['k_pages']}, {dtypes['v_pages']}")
    check_settings(block_size, page_size, eta)
    table = shapes["page_table"]
    if len(table) != 2 or table[0] != batch or dtypes["page_table"] != "int32":
        raise ValueError(f"page_table must be int32[batch={batch}, max_pages], got "
                         f"{dtypes['page_table']}{list(table)}")
    for name in ("seq_lens", "modes"):
        if shapes[name] != (batch,) or dtypes[name] != "int32":
            raise ValueError(f"{name} must be int32[batch={batch}], got {dtypes[name]}{list(shapes[name])}")
    max_blocks = table[1] * page_size // block_size
    if shapes["support"] != (batch, heads, max_blocks) or dtypes["support"] != "bool":
        raise ValueError(f"support must be bool[{batch}, {heads}, {max_blocks}] (max_pages * page_size // "
                         f"block_size blocks), got {dtypes['support']}{list(shapes['support'])}")


def _rows(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(mask).tolist()


def check_values(page_table: np.ndarray, seq_lens: np.ndarray, modes: np.ndarray, support: np.ndarray, *,
                 num_pages: int, page_size: int, block_size: int, reuse: bool = False) -> None:
    """The values of a call whose shapes passed `check_inputs` (numpy arrays):

    1 <= seq_lens[b] <= max_pages * page_size; modes in `wise_core.modes` (SPARSE or DENSE in a
    reuse loop's call, `reuse`: no row discovers); the pages a row uses
    (page_table[b, :ceil(seq_lens[b] / page_size)]) in [0, num_pages); every head of a SPARSE
    row selects at least one causal block."""
    lens, modes = np.asarray(seq_lens, np.int64), np.asarray(modes)
    table, support = np.asarray(page_table), np.asarray(support, bool)
    capacity = table.shape[1] * page_size
    bad = (lens < 1) | (lens > capacity)
    if bad.any():
        raise ValueError(f"seq_lens must be in [1, {capacity}] (max_pages * page_size): rows {_rows(bad)} "
                         f"hold {lens[bad].tolist()}")
    unknown = ~np.isin(modes, list(M.NAMES))
    if unknown.any():
        raise ValueError(f"modes must be one of {M.NAMES}: rows {_rows(unknown)} hold {modes[unknown].tolist()}")
    discovering = reuse & ~np.isin(modes, [M.SPARSE, M.DENSE])
    if discovering.any():
        raise ValueError(f"modes of a reuse call must be SPARSE or DENSE: rows {_rows(discovering)} hold "
                         f"{[M.NAMES[m] for m in modes[discovering].tolist()]}")
    used = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // page_size)
    outside = used & ((table < 0) | (table >= num_pages))
    if outside.any():
        rows = _rows(outside.any(-1))
        raise ValueError(f"page_table: rows {rows} use pages {table[outside].tolist()[:8]} outside the pool "
                         f"[0, {num_pages})")
    causal = np.arange(support.shape[-1])[None, :] * block_size < lens[:, None]      # [batch, max_blocks]
    empty = ~(support & causal[:, None, :]).any(-1) & (modes == M.SPARSE)[:, None]  # [batch, heads]
    if empty.any():
        rows, heads = np.nonzero(empty)
        raise ValueError(f"support: SPARSE rows {sorted(set(rows.tolist()))} select no causal block "
                         f"(row, head): {list(zip(rows.tolist(), heads.tolist()))[:8]}")
