"""The counters and timings both frameworks report: an engine's since it started or its stats were
reset (`EngineStats`), and one `generate` / `teacher_force` call's (`GenerationStats`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    """Pool, queue and WISE counters, and throughput since the engine started or its stats were
    reset (seconds are host wall time around the synchronised model calls). fallbacks and
    density (per reuse depth; None before any reuse call) are None without WISE; the
    speculative counters ((sequence, round) pairs, drafts proposed, drafts accepted) are None
    without speculative decoding. wise_jax's preemptions is always 0 (admission reserves a
    request's lifetime). Decode programs: a step runs at a (batch bucket, context bucket), one
    program each (torch: a CUDA graph, 0 when eager; JAX: a compiled step), made lazily the first
    time a step needs it: step_programs made so far, step_program_bound the most there can be,
    step_build_s the seconds spent making them (capture, or trace and compile), and
    step_memory_bytes the memory they hold beside the weights and the pool (torch: the graphs'
    shared pool; JAX: the compiled steps' temporaries). pool_sizing says how the page pool was
    sized. Prefix caching: prefix_cache_queries, the prompt tokens of the requests looked up,
    and prefix_cache_hits, those found cached (their prefill skipped), since the engine started;
    forked_prompt_tokens: prompt tokens the later completions of n > 1 requests took from their
    first completion's pages instead of prefilling them. prefill_attention: the prefill
    attention that runs (torch: "sdpa", "fa4" or "reference"; "" where the engine has no choice);
    wise_decode: what runs the WISE loops (torch: "kernel", the attention_backend's decode
    kernel; "fa4-union" or "reference-union" in a benchmark's arm, docs/attention.md; ""
    where the engine has no choice). mean_decode_depth: with early exit (an Ouro model's
    early_exit_threshold < 1, a Huginn engine's adaptive_depth), the loops (Huginn: core
    iterations) a decoded token ran on average over the decode steps (each token's exit loop +
    1; prefill not counted); None without early exit or before any decode step.
    larger_bucket_steps (JAX): decode, prefill and first-token programs run in a larger compiled
    bucket than their step's own while theirs compiled in the background; compile_blocked_steps
    and compile_blocked_s: the programs a step waited for to compile and the seconds it waited
    (`wise_jax.engine.compiler`; torch: 0, its graphs are captured on the step path, counted in
    step_build_s).
    failed_step_programs: the steps whose program could not be made, each run eagerly from then
    on with the same tokens (torch: the CUDA-graph captures that failed, decode's as (batch
    bucket, context bucket), speculation's with its kind first; JAX: always (), a compile error
    raises)."""

    total_pages: int
    free_pages: int
    running: int
    waiting: int
    preemptions: int
    fallbacks: int | None
    density: dict[int, float | None] | None
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    decode_tokens: int
    spec_rounds: int | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    step_programs: int = 0
    step_program_bound: int = 0
    step_build_s: float = 0.0
    step_memory_bytes: int = 0
    failed_step_programs: tuple[tuple, ...] = ()
    pool_sizing: str = ""
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    forked_prompt_tokens: int = 0
    prefill_attention: str = ""
    wise_decode: str = ""
    mean_decode_depth: float | None = None
    larger_bucket_steps: int = 0
    compile_blocked_steps: int = 0
    compile_blocked_s: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found cached / prompt tokens looked up (None before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def acceptance_rate(self) -> float | None:
        """Drafts the dense model accepted / drafts proposed (None without speculation or drafts)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_round(self) -> float | None:
        """Tokens a sequence commits per speculative round (None without speculation or rounds)."""
        return self.decode_tokens / self.spec_rounds if self.spec_rounds else None

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0


@dataclasses.dataclass
class GenerationStats:
    """Timings (seconds, device-synchronised) and WISE counters of one `generate` or
    `teacher_force` call.

    new_tokens: tokens produced (generate) or scored (teacher_force); decode_tokens_per_s counts
    the tokens of decode steps (the first token of each row comes from prefill). fallbacks and
    density (per reuse depth) are None without WISE.
    """

    prefill_s: float
    prefill_tokens: int
    decode_s: float
    decode_tokens_per_s: float
    new_tokens: int
    fallbacks: int | None
    density: dict[int, float | None] | None
