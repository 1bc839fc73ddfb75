"""Process settings that must precede the first import of triton or jax (imported for effect).

Without a CUDA device, Triton kernels run in the interpreter (`TRITON_INTERPRET=1`); XLA does not
preallocate the GPU that torch shares. Both only set defaults: an explicit setting wins.
`widen_interpreted_bf16_dots` makes the interpreter's bf16 dots compute what a GPU computes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def widen_interpreted_bf16_dots() -> None:
    """Triton's interpreter multiplies bf16 tl.dot operands as their raw uint16 storage; widen
    them to float32 first (exact, as a GPU's bf16 products are), so GQA and tensor-core MHA in
    bf16 run under the interpreter too. Idempotent; call it after setting TRITON_INTERPRET=1."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    create_dot = builder.create_dot

    def widened(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    widened.widens_bf16 = True
    builder.create_dot = widened
