"""PyTorch implementation of wise: the Ouro decoder, paged KV cache, WISE decode and generation."""

from wise_torch.generate import ForcedOutput, GenerationOutput, GenerationStats, generate, teacher_force
from wise_torch.kv_cache import DecodeBatch, KVCacheExhausted, PagedKVCache
from wise_torch.model import OuroForCausalLM, from_tensors, load_model, to_checkpoint_tensors
from wise_torch.wise_state import WiseSlotsExhausted, WiseState

__all__ = ["ForcedOutput", "GenerationOutput", "GenerationStats", "generate", "teacher_force",
           "DecodeBatch", "KVCacheExhausted", "PagedKVCache", "OuroForCausalLM", "from_tensors", "load_model",
           "to_checkpoint_tensors", "WiseSlotsExhausted", "WiseState"]
