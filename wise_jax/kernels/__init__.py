"""Pallas kernels of the JAX path; `pallas_decode.decode_attention` is the paged WISE decode."""
