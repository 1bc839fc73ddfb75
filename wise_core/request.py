"""What both engines (wise_torch.LLM, wise_jax.LLM) take and give, under one name: a re-export
only (nothing is defined here), for users who want one import and for the modules that still
import from here. Each lives in the module of its job:

- `wise_core.sampling_params`: `SamplingParams` (with `MAX_SEED`, `MAX_LOGPROBS`), and
  `LLM.generate`'s prompts paired with their params (`prompts_with_params`) and queued (`add_all`);
- `wise_core.outputs`: `RequestOutput`, `CompletionOutput`, `Logprob`;
- `wise_core.stats`: `EngineStats` (an engine's counters), `GenerationStats` (one `generate` call's).
"""

from wise_core.outputs import CompletionOutput, Logprob, RequestOutput
from wise_core.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams, add_all, prompts_with_params
from wise_core.stats import EngineStats, GenerationStats

__all__ = ["CompletionOutput", "EngineStats", "GenerationStats", "Logprob", "MAX_LOGPROBS", "MAX_SEED",
           "RequestOutput", "SamplingParams", "add_all", "prompts_with_params"]
