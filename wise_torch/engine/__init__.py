"""The serving engine: continuous batching, chunked prefill, preemption, CUDA-graph decode."""

from wise_core.outputs import RequestOutput
from wise_core.sampling_params import SamplingParams
from wise_core.stats import EngineStats
from wise_torch.engine.llm import LLM

__all__ = ["LLM", "EngineStats", "RequestOutput", "SamplingParams"]
