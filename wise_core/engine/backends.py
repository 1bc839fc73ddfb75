"""Which engine each backend names and the options it takes, framework-free: what `build_engine`
(wise_serve.model) checks before it imports the framework of the backend asked for.

Each engine takes `EngineArgs`' fields (both) beside its own options (`BACKEND_OPTIONS`: the
keyword arguments of `wise_torch.LLM` and `wise_jax.LLM` after the model). A dtype may be given
by name (`DTYPES`) to either backend.
"""

from __future__ import annotations

import dataclasses

from wise_core.engine.args import ATTENTION_BACKENDS, EngineArgs

BACKENDS = ("torch", "jax")
"""The engines: "torch" is wise_torch.LLM, "jax" is wise_jax.LLM."""

BACKEND_OPTIONS = {
    "torch": ("num_steps", "adaptive_depth", "adaptive_regroup", "cuda_graphs", "dtype", "device",
              "speculative_config", "tensor_parallel_size"),
    "jax": ("config", "tokenizer", "unroll", "mesh", "dtype", "num_steps", "adaptive_depth", "background_compile",
            "compilation_cache"),
}
"""Each engine's own keyword arguments, beside EngineArgs' (the LLM constructors' signatures)."""

ENGINE_ARGS = tuple(field.name for field in dataclasses.fields(EngineArgs))

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes either engine loads a model in, by name."""


def check_backend(backend) -> str:
    """`backend` if it names an engine, else a ValueError naming it and the engines."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: the engines are {', '.join(map(repr, BACKENDS))}")
    return backend


def check_engine_options(backend: str, options: dict) -> None:
    """The keyword arguments given for `backend`'s engine: each an EngineArgs field or one of the
    backend's own options (else a ValueError naming the option, and the backend that takes it
    when the other does), a dtype name among DTYPES, an attention_backend of the backend's
    (`ATTENTION_BACKENDS`)."""
    check_backend(backend)
    for name in options:
        if name in ENGINE_ARGS or name in BACKEND_OPTIONS[backend]:
            continue
        others = [b for b in BACKENDS if b != backend and name in BACKEND_OPTIONS[b]]
        if others:
            raise ValueError(f"{name} is an option of the {others[0]} engine; the {backend} engine does not take it")
        raise ValueError(f"unknown engine option {name!r} for the {backend} engine (options: EngineArgs' "
                         f"{', '.join(ENGINE_ARGS)}; the {backend} engine's {', '.join(BACKEND_OPTIONS[backend])})")
    dtype = options.get("dtype")
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one an engine loads ({', '.join(DTYPES)})")
    attention = options.get("attention_backend")
    if isinstance(attention, str) and attention not in ATTENTION_BACKENDS[backend]:
        raise ValueError(f"attention_backend {attention!r} is not one of the {backend} engine's "
                         f"({', '.join(ATTENTION_BACKENDS[backend])})")
