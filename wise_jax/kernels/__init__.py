"""Pallas kernels of the JAX path, paged WISE decode: `pallas_decode` (Triton lowering) and
`mosaic_decode` (its split kernel on Mosaic GPU); `choice` picks the one kernel="pallas" runs."""
