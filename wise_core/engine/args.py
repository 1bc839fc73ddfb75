"""The engine arguments both frameworks take, with one set of defaults and one validation.

    wise_torch.LLM(model, max_num_seqs=64)   # and wise_jax.LLM(params, config, max_num_seqs=64)

Each engine takes these as keyword arguments beside its own (torch: cuda_graphs, dtype, device,
speculative_config, tensor_parallel_size; JAX: tokenizer, unroll, mesh, dtype). The pool's
size from device memory (num_pages=None) is the framework's measure of free memory through
`pool_pages`.
"""

from __future__ import annotations

import dataclasses
import numbers

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.generate_args import check_seed
from wise_core.kv_quant import check_kv_cache_dtype
from wise_core.model_config import ModelConfig
from wise_core.wise_config import WiseConfig

CPU_POOL_BYTES = 1 << 30       # num_pages=None on a CPU: a pool of at most 1 GiB of K/V
MAX_PAGES = 2 ** 31 - 1        # page ids are int32 on the device

ATTENTION_BACKENDS = {"torch": ("auto", "triton", "fa4", "reference"), "jax": ("auto", "pallas", "reference")}
"""Each framework's `EngineArgs.attention_backend` values; what each runs in prefill, the dense
decode loops and the WISE loops is docs/attention.md's table (derived in one place per framework:
`wise_torch.attention.attention_plan`, `wise_jax.attention.attention_plan`)."""


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """wise_config: decode with WISE (None: dense). num_pages: pages in the pool (None: sized
    from free device memory, `pool_pages`); page_size: tokens per page, a multiple of the WISE
    block size. max_num_seqs: requests decoding at once (rows of the per-sequence device
    buffers). max_model_len: prompt + output tokens a request may hold (None: the model's
    max_position_embeddings, at most the pool); it sizes page tables and WISE block tables.
    max_num_batched_tokens: tokens one step runs (decode rows, then prompt chunks: chunked
    prefill). attention_backend: which attention implementations run prefill and decode, one
    name for the whole engine (`ATTENTION_BACKENDS`: torch "auto", "triton", "fa4", "reference";
    JAX "auto", "pallas", "reference"; docs/attention.md's table says what each runs in every
    phase; "auto": the fastest that runs here). seed: the random state of requests without
    their own seed (None: a random one).
    enable_prefix_caching: share the K/V of full prompt pages across requests with the same
    prefix, their prefill skipped (`wise_core.engine.block_manager`); the tokens are those of a
    run without it. kv_cache_dtype: how the pool holds K/V: "auto" in the model's dtype; "fp8"
    as float8 e4m3fn codes (a byte a value) and one float32 scale per (token, KV head), by
    `wise_core.kv_quant`'s rule, every attention reading them dequantized (about 1.9x the tokens
    of bf16 in the same memory; Ouro models only so far; attention_backend "auto" or
    "reference", and JAX's "pallas": docs/attention.md)."""

    wise_config: WiseConfig | None = None
    num_pages: int | None = None
    page_size: int = 128
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    attention_backend: str = "auto"
    seed: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.wise_config is not None and not isinstance(self.wise_config, WiseConfig):
            raise TypeError(f"wise_config must be a WiseConfig or None, got {type(self.wise_config).__name__}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "num_pages", "max_model_len"):
            value = getattr(self, name)
            if value is not None or name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
                positive_int(name, value)
        if self.num_pages is not None and self.num_pages > MAX_PAGES:
            raise ValueError(f"num_pages must be at most {MAX_PAGES} (page ids are int32 on the device), got "
                             f"{self.num_pages}")
        if self.page_size % self.block_size:
            raise ValueError(f"page_size must be a multiple of the block_size {self.block_size}, got {self.page_size}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        names = sorted({name for names in ATTENTION_BACKENDS.values() for name in names})
        if self.attention_backend not in names:
            raise ValueError(f"attention_backend must be one of {', '.join(map(repr, names))} (torch: "
                             f"{', '.join(ATTENTION_BACKENDS['torch'])}; jax: {', '.join(ATTENTION_BACKENDS['jax'])}), "
                             f"got {self.attention_backend!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        object.__setattr__(self, "seed", check_seed(self.seed))

    @property
    def block_size(self) -> int:
        return (self.wise_config or WiseConfig()).block_size

    def checked_for(self, num_loops: int, max_position_embeddings: int, what: str | None = None) -> "EngineArgs":
        """Self, checked against a model of `num_loops` loops (`what` names them in an error, as
        `WiseConfig.validate_for`'s) and that many positions."""
        if num_loops < 1:
            raise ValueError(f"{what or f'{num_loops} loops'}: an engine runs at least one core iteration per token "
                             f"(num_steps must be >= 1)")
        if self.wise_config is not None:
            self.wise_config.validate_for(num_loops, what)
        if self.max_model_len is not None and self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({max_position_embeddings})")
        return self

    def model_len(self, max_position_embeddings: int, num_pages: int) -> int:
        """max_model_len, or its default: the model's positions, at most what the pool holds."""
        if self.max_model_len is not None:
            return self.max_model_len
        return min(max_position_embeddings, num_pages * self.page_size)

    def pages_per_request(self, max_position_embeddings: int) -> int:
        """The most pages one request can hold (max_model_len, or the model's positions)."""
        return -(-(self.max_model_len or max_position_embeddings) // self.page_size)


def pool_pages(budget_bytes: int, page_bytes: int, rule: str, most: int) -> tuple[int, str]:
    """(pages, how they were sized) for num_pages=None: the pages of `page_bytes` that fit
    `budget_bytes` (the framework's measure, described by `rule`), at most `most` (max_num_seqs
    requests of max_model_len: more could never be held). ValueError when not one page fits."""
    pages = min(most, budget_bytes // page_bytes)
    if pages < 1:
        raise ValueError(f"too little free device memory for one KV page ({page_bytes} bytes; {rule}); pass num_pages")
    sizing = f"{rule}: {pages} pages of {page_bytes} bytes"
    if pages == most and most * page_bytes < budget_bytes:
        sizing += f", capped at max_num_seqs x pages per request ({most})"
    return pages, sizing


def cpu_pool(page_bytes: int, platform: str, most: int) -> tuple[int, str]:
    """`pool_pages` on a CPU: CPU_POOL_BYTES of K/V."""
    return pool_pages(CPU_POOL_BYTES, page_bytes, f"at most {CPU_POOL_BYTES / 2**30:.0f} GiB of K/V on a {platform}",
                      most)


def host_available_bytes() -> int | None:
    """The host memory free for new allocations (Linux MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_pool_fits(num_pages: int, page_bytes: int, available_bytes: int | None, where: str) -> None:
    """A pool of num_pages pages of page_bytes (K and V, every plane) larger than the memory
    available for it (`where` names that memory; None: unknown, not checked) is a ValueError
    saying the bytes it would need, before anything is allocated."""
    need = num_pages * page_bytes
    if available_bytes is not None and need > available_bytes:
        raise ValueError(f"num_pages={num_pages} pages of {page_bytes} bytes (K and V of every plane) need "
                         f"{need / 2**30:.2f} GiB, more than the {available_bytes / 2**30:.2f} GiB {where}: pass a "
                         f"smaller num_pages (or page_size, or a Huginn model's num_steps)")


def check_adaptive_depth(adaptive_depth, config: ModelConfig) -> AdaptiveDepth | None:
    """An engine's adaptive_depth, checked: None, or an `AdaptiveDepth` for a Huginn model (an
    Ouro model exits by its config's early_exit_threshold)."""
    if adaptive_depth is None:
        return None
    if not isinstance(adaptive_depth, AdaptiveDepth):
        raise TypeError(f"adaptive_depth must be an AdaptiveDepth or None, got {type(adaptive_depth).__name__}")
    if config.architecture != "huginn":
        raise ValueError(f"adaptive_depth runs Huginn models; this {config.architecture} model exits by its "
                         f"config's early_exit_threshold ({config.early_exit_threshold})")
    return adaptive_depth


def check_exit_iterations(adaptive_depth: AdaptiveDepth | None, num_steps: int) -> None:
    """adaptive_depth's exit is checked after core iterations min_steps .. num_steps - 2 (the last
    runs anyway): a min_steps that leaves none would silently never exit, so it is a ValueError."""
    if adaptive_depth is not None and adaptive_depth.min_steps > num_steps - 2:
        raise ValueError(f"AdaptiveDepth.min_steps={adaptive_depth.min_steps} leaves no core iteration to exit "
                         f"after with num_steps={num_steps} (exits are checked after iterations min_steps .. "
                         f"num_steps - 2): min_steps must be at most {num_steps - 2}")


def positive_int(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
