"""The serving engine: continuous batching, chunked prefill, preemption, CUDA-graph decode."""

from wise_core.request import EngineStats, RequestOutput, SamplingParams
from wise_torch.engine.llm import LLM

__all__ = ["LLM", "EngineStats", "RequestOutput", "SamplingParams"]
