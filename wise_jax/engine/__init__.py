"""The JAX serving engine: `LLM` (llm.py) over the shared host side `wise_core.engine`; its
device programs (programs.py), their ahead-of-time and background compiles (compiler.py), row
sampling (sampler.py) and in-flight reads (inflight.py)."""

from wise_jax.engine.llm import (COMPILATION_CACHE, GPU_POOL_FRACTION, LLM, seed_key,  # noqa: F401
                                 use_compilation_cache)
from wise_core.outputs import RequestOutput  # noqa: F401
from wise_core.sampling_params import SamplingParams  # noqa: F401
from wise_core.stats import EngineStats  # noqa: F401

__all__ = ["LLM", "EngineStats", "RequestOutput", "SamplingParams", "seed_key", "use_compilation_cache",
           "COMPILATION_CACHE", "GPU_POOL_FRACTION"]
