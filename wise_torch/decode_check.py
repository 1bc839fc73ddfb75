"""The decode contract (`wise_core.decode_contract`) checked at a call: what the reference in
`wise_torch.attention` and the Triton kernel run at their public entry (its own module, so the
kernels and the dispatcher import it, not each other)."""

from __future__ import annotations

import torch

from wise_core import decode_contract
from wise_core import kv_quant


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size, eta,
               validate: bool, reuse: bool = False, k_scale=None, v_scale=None) -> None:
    """The decode contract (`wise_core.decode_contract`) at a public entry: shapes, dtypes and
    settings always (no device sync); with `validate` also the values, read on the host (a
    device sync: callers that build the inputs by construction pass validate=False). reuse: a
    reuse loop's call (no row discovers). k_scale, v_scale: an fp8 cache's scales float32
    [num_pages, page_size, kv_heads], k_pages and v_pages then uint8 codes
    (`wise_core.kv_quant.check_dequantize_input`), checked as pages of q's dtype otherwise."""
    arrays = dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, seq_lens=seq_lens,
                  modes=modes, support=support)
    dtypes = {name: _dtype_name(t) for name, t in arrays.items()}
    if k_scale is not None or v_scale is not None:
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale and v_scale must be given together (an fp8 cache's scales) or both be None")
        for pages, scales, name in ((k_pages, k_scale, "k"), (v_pages, v_scale, "v")):
            try:
                kv_quant.check_dequantize_input(tuple(pages.shape), _dtype_name(pages), tuple(scales.shape),
                                                _dtype_name(scales), "float32")
            except ValueError as e:
                raise ValueError(f"fp8 pages {name}_pages / {name}_scale: {e}") from None
        dtypes["k_pages"] = dtypes["v_pages"] = dtypes["q"]    # read as q's dtype (decode_contract checks it)
    decode_contract.check_inputs({name: tuple(t.shape) for name, t in arrays.items()}, dtypes,
                                 block_size=block_size, eta=eta)
    if validate:
        decode_contract.check_values(*(t.cpu().numpy() for t in (page_table, seq_lens, modes, support)),
                                     num_pages=k_pages.shape[0], page_size=k_pages.shape[1],
                                     block_size=block_size, reuse=reuse)
