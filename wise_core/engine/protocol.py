"""What a serving engine offers its callers (`wise generate`, `wise serve`, benchmarks): the
methods both `wise_torch.LLM` and `wise_jax.LLM` have (`LLMEngine`), as a typing Protocol, so a
caller written against it serves either framework."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from wise_core.wise_config import WiseConfig
from wise_core.outputs import RequestOutput
from wise_core.sampling_params import SamplingParams
from wise_core.stats import EngineStats


@runtime_checkable
class Engine(Protocol):
    """vocab_size: the model's; max_model_len: prompt + output tokens a request may hold;
    page_size and blocks.num_pages: the pool's; wise_config: None when dense. Every method is
    `LLMEngine`'s (its docstrings). An engine is used from one thread at a time (a second
    thread inside is a RuntimeError)."""

    vocab_size: int
    max_model_len: int
    page_size: int
    wise_config: WiseConfig | None

    def add_request(self, prompt, params: SamplingParams | None = None) -> int: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: int) -> RequestOutput: ...

    def has_unfinished(self) -> bool: ...

    def prompt_token_ids(self, request_id: int) -> list[int]: ...

    def stats(self) -> EngineStats: ...

    def get_tokenizer(self): ...

    def generate(self, prompts, params=None, *, use_tqdm: bool = True) -> list[RequestOutput]: ...

    def run_until_done(self, request_ids: list[int], *, use_tqdm: bool = False) -> list[RequestOutput]: ...
