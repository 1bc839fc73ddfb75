"""The serving engine: continuous batching, chunked prefill, preemption, CUDA-graph decode."""

from wise_torch.engine.llm import LLM, EngineStats
from wise_torch.engine.sequence import RequestOutput, SamplingParams

__all__ = ["LLM", "EngineStats", "RequestOutput", "SamplingParams"]
