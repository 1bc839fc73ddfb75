"""The decode contract (`wise_core.decode_contract`) checked at a call: what the reference in
`wise_jax.attention` and the Pallas kernels in `wise_jax.kernels` both run at their public
entry (its own module, so the kernels and the dispatcher import it, not each other)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from wise_core import decode_contract
from wise_core import kv_quant


def _described(arrays: dict) -> tuple[dict, dict]:
    return ({name: tuple(x.shape) for name, x in arrays.items()},
            {name: jnp.dtype(x.dtype).name for name, x in arrays.items()})


def check_call(q, k_pages, v_pages, page_table, seq_lens, modes, support, *, block_size, eta,
               validate: bool, reuse: bool = False, k_scale=None, v_scale=None) -> jax.Array:
    """The decode contract (`wise_core.decode_contract`) at a public entry; returns seq_lens.

    Shapes, dtypes and settings are always checked (at trace time under jit). With `validate`
    the values are checked too: concrete arrays directly; traced ones (under jit) by a host
    callback that the returned seq_lens depends on, so the attention runs only after the check
    passed, and a failure raises (as a JaxRuntimeError carrying the ValueError's message) when
    the result is read. The callback is a device-host round trip per call: callers that build
    the inputs by construction pass validate=False. reuse: a reuse loop's call (no row
    discovers; `decode_contract.check_values`). k_scale, v_scale: an fp8 cache's scales
    float32 [num_pages, page_size, kv_heads], k_pages and v_pages then uint8 codes
    (`wise_core.kv_quant.check_dequantize_input`), checked as pages of q's dtype otherwise."""
    arrays = dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, seq_lens=seq_lens,
                  modes=modes, support=support)
    shapes, dtypes = _described(arrays)
    if k_scale is not None or v_scale is not None:
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale and v_scale must be given together (an fp8 cache's scales) or both be None")
        for pages, scales, name in ((k_pages, k_scale, "k"), (v_pages, v_scale, "v")):
            try:
                kv_quant.check_dequantize_input(tuple(pages.shape), jnp.dtype(pages.dtype).name, tuple(scales.shape),
                                                jnp.dtype(scales.dtype).name, "float32")
            except ValueError as e:
                raise ValueError(f"fp8 pages {name}_pages / {name}_scale: {e}") from None
        dtypes["k_pages"] = dtypes["v_pages"] = dtypes["q"]    # read as q's dtype (decode_contract checks it)
    decode_contract.check_inputs(shapes, dtypes, block_size=block_size, eta=eta)
    if not validate:
        return seq_lens
    num_pages, page_size = k_pages.shape[:2]

    def check(page_table, seq_lens, modes, support):
        decode_contract.check_values(page_table, seq_lens, modes, support, num_pages=num_pages,
                                     page_size=page_size, block_size=block_size, reuse=reuse)
        return np.bool_(True)

    values = (page_table, seq_lens, modes, support)
    try:
        concrete = [np.asarray(x) for x in values]
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        passed = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.bool_), *values)
        return jnp.where(passed, seq_lens, 0)
    check(*concrete)
    return seq_lens
