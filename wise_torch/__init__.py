"""PyTorch implementation of wise: the Ouro decoder, paged KV cache, WISE decode, the serving engine."""

from wise_core.speculative_config import SpeculativeConfig
from wise_torch.engine import LLM, EngineStats, RequestOutput, SamplingParams
from wise_torch.generate import ForcedOutput, GenerationOutput, GenerationStats, generate, teacher_force
from wise_torch.kv_cache import DecodeBatch, PagedKVCache, PrefillBatch
from wise_torch.loading import from_tensors, load_model
from wise_torch.model import OuroForCausalLM, to_checkpoint_tensors
from wise_torch.wise_state import WiseState

__all__ = ["LLM", "EngineStats", "RequestOutput", "SamplingParams", "SpeculativeConfig", "ForcedOutput",
           "GenerationOutput", "GenerationStats", "generate", "teacher_force", "DecodeBatch", "PagedKVCache",
           "PrefillBatch", "OuroForCausalLM", "from_tensors", "load_model", "to_checkpoint_tensors", "WiseState"]
