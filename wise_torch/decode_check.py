"""The decode contract (`wise_core.decode_contract`) checked at a call: what the reference in
`wise_torch.attention` and the Triton kernel run at their public entry (its own module, so the
kernels and the dispatcher import it, not each other)."""

from __future__ import annotations

import torch

from wise_core import decode_contract


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size, eta,
               validate: bool, reuse: bool = False) -> None:
    """The decode contract (`wise_core.decode_contract`) at a public entry: shapes, dtypes and
    settings always (no device sync); with `validate` also the values, read on the host (a
    device sync: callers that build the inputs by construction pass validate=False). reuse: a
    reuse loop's call (no row discovers)."""
    arrays = dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, seq_lens=seq_lens,
                  modes=modes, support=support)
    decode_contract.check_inputs({name: tuple(t.shape) for name, t in arrays.items()},
                                 {name: _dtype_name(t) for name, t in arrays.items()},
                                 block_size=block_size, eta=eta)
    if validate:
        decode_contract.check_values(*(t.cpu().numpy() for t in (page_table, seq_lens, modes, support)),
                                     num_pages=k_pages.shape[0], page_size=k_pages.shape[1],
                                     block_size=block_size, reuse=reuse)
