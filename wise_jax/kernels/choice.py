"""Which Pallas kernel `kernel="pallas"` runs: the one place that chooses.

`mosaic_decode` (its split kernel on Mosaic GPU) when the call runs on a Hopper GPU (compute
capability 9.x) with what it takes (16-bit q/K/V, head_dim a multiple of 64); otherwise
`pallas_decode` (the Triton lowering: every dtype, head_dim a power of two or a multiple of 16
such as huginn-0125's 96, fp8 pages, the CI path). The choice is per call and covers
every row of it (one backend per call keeps a SPARSE row with every block selected bitwise
DENSE).

Mosaic runs wherever it can because it was the faster of the two in every mode on an H200
(docs/kernels/mosaic_decode.md has the numbers); a measurement of the Triton-lowered kernel on
Hopper calls `pallas_decode` directly (benchmarks/kernels/bench_pallas.py).
"""

from __future__ import annotations

import jax

from wise_jax.kernels import pallas_decode


def on_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def uses_mosaic(head_dim: int, dtype) -> bool:
    """Whether a call with q of this head_dim and dtype runs the Mosaic GPU kernel."""
    if not on_sm90():
        return False
    from wise_jax.kernels import mosaic_decode
    return mosaic_decode.supports(head_dim, dtype)


def decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes, support, **kwargs):
    """`pallas_decode.decode_attention`'s contract, run by the chosen kernel (module docstring)."""
    if kwargs.get("k_scale") is None and uses_mosaic(q.shape[-1], q.dtype):   # fp8 pages: pallas_decode reads them
        from wise_jax.kernels import mosaic_decode
        return mosaic_decode.decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes,
                                              support, **kwargs)
    return pallas_decode.decode_attention(q, k_pages, v_pages, page_table, seq_lens, modes,
                                          support, **kwargs)
