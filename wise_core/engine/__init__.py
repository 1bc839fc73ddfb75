"""The host side of the serving engine, shared by wise_torch and wise_jax: sequences, the page
pool's bookkeeping, the scheduler (continuous batching, chunked prefill, preemption), the
engine arguments, the step loop (`LLMEngine`) and the protocol callers rely on (`Engine`).
Pure Python: each framework adds only its device side."""

from wise_core.engine.args import EngineArgs
from wise_core.engine.llm_engine import InFlight, LLMEngine
from wise_core.engine.protocol import Engine

__all__ = ["Engine", "EngineArgs", "InFlight", "LLMEngine"]
