"""Which Pallas kernel `kernel="pallas"` runs: the one place that chooses.

`pallas_decode` (the Triton lowering: every dtype and power-of-two head_dim, the CI path) unless
`MOSAIC_ON_SM90` is set and the call runs on a Hopper GPU (compute capability 9.x) with what
`mosaic_decode` takes (16-bit q/K/V, head_dim a multiple of 64). The choice is per call and
covers every row of it (one backend per call keeps a SPARSE row with every block selected
bitwise DENSE). Set the flag from an H200 run of `benchmarks/bench_pallas.py` (impl "mosaic"
against impl "pallas", per mode and shape): it stays off until the Mosaic GPU kernel is
measured faster.
"""

from __future__ import annotations

import jax

from wise_jax.kernels import pallas_decode

MOSAIC_ON_SM90 = False


def on_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def uses_mosaic(head_dim: int, dtype) -> bool:
    """Whether a call with q of this head_dim and dtype runs the Mosaic GPU kernel."""
    if not (MOSAIC_ON_SM90 and on_sm90()):
        return False
    from wise_jax.kernels import mosaic_decode
    return mosaic_decode.supports(head_dim, dtype)


def decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes, support, **kwargs):
    """`pallas_decode.decode_attention`'s contract, run by the chosen kernel (module docstring)."""
    if uses_mosaic(q.shape[-1], q.dtype):
        from wise_jax.kernels import mosaic_decode
        impl = mosaic_decode.decode_attention
    else:
        impl = pallas_decode.decode_attention
    return impl(q, k_pages, v_pages, page_table, seq_lens, modes, support, **kwargs)
