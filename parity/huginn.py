"""Greedy Huginn generation in both frameworks over the paged cache, dense or WISE over core
iterations (`wise_torch.huginn`, `wise_jax.huginn`): what the Huginn rows of the parity checks
and the Huginn WISE tests run.

Each prompt is prefilled alone (densely) into its own pages of PAGE_SIZE keys, then every prompt
decodes one token a step as one batch, the core block run `num_steps` times from the seeded
initial state (`wise_core.huginn_reference.initial_state`) of each position.
"""

from __future__ import annotations

import functools
import time

from parity import environment  # noqa: F401  (before triton and jax are imported)

import jax.numpy as jnp
import numpy as np
import torch

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.huginn_reference import initial_state, num_planes
from wise_core.model_config import ModelConfig
from wise_core.modes import DENSE
from wise_core.wise_config import WiseConfig
from wise_jax import huginn as jax_huginn
from wise_jax import kv_cache as kvc
from wise_jax import wise_state as jax_ws
from wise_torch.attention import decode_attention
from wise_torch.huginn import HuginnForCausalLM
from wise_torch.kv_cache import DecodeBatch, PagedKVCache, PrefillBatch, PrefillGroup
from wise_torch.wise_state import WiseState

PAGE_SIZE = 32


def _pages(prompts: list[list[int]], max_new_tokens: int, pages: int | None = None) -> int:
    """Pages per request: `pages`, else those of the longest prompt and its new tokens (at least
    those: a larger pool gives the same tokens, and one shape serves prompts of several lengths)."""
    need = -(-(max(map(len, prompts)) + max_new_tokens) // PAGE_SIZE)
    if pages is not None and pages < need:
        raise ValueError(f"pages={pages} per request hold fewer than the {need} the prompts and new tokens need")
    return need if pages is None else pages


def _blocks(pages: int, wise_config: WiseConfig | None) -> int:
    return pages * PAGE_SIZE // (WiseConfig() if wise_config is None else wise_config).block_size


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def torch_generate(model: HuginnForCausalLM, prompts: list[list[int]], *, max_new_tokens: int, num_steps: int,
                   seed: int = 0, wise_config: WiseConfig | None = None, kernel: str = "reference",
                   adaptive: AdaptiveDepth | None = None, depths: list[list[int]] | None = None,
                   pages: int | None = None, regroup: bool = False, step_times: list[float] | None = None):
    """Greedy tokens per prompt (max_new_tokens each, no early stop), their logits
    float32[max_new_tokens, vocab] per prompt (numpy), and the WiseState (None when dense).
    kernel: `wise_torch.attention.decode_attention`'s (which runs the WiseConfig's selection rule).
    adaptive: per-token adaptive depth in decode; depths, if given, gets each prompt's list of
    the iterations its decode steps ran. pages: each request's pages (`_pages`; None: what the
    longest prompt and its tokens need). regroup: decode_step's (adaptive only). step_times, if
    given, gets the wall seconds of each decode_step call (the device synchronized)."""
    config, device = model.config, model.head_weight.device
    rows, pages = len(prompts), _pages(prompts, max_new_tokens, pages)
    cache = PagedKVCache(planes=num_planes(config, num_steps), num_pages=rows * pages, page_size=PAGE_SIZE,
                         kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                         dtype=model.head_weight.dtype, device=device)
    table = torch.arange(rows * pages, device=device).view(rows, pages)
    blocks = _blocks(pages, wise_config)
    wise = None if wise_config is None else WiseState(wise_config, config, max_rows=rows, max_blocks=blocks,
                                                      device=device)
    attention = functools.partial(decode_attention, kernel=kernel,
                                  selection=None if wise_config is None else wise_config.selection)

    def slots(r, positions):
        return torch.tensor([int(table[r, p // PAGE_SIZE]) * PAGE_SIZE + p % PAGE_SIZE for p in positions],
                            device=device)

    def state(positions):
        return torch.cat([model.initial_state(1, range(p, p + 1), seed) for p in positions])

    logits = [[] for _ in prompts]
    dense_modes = torch.full((rows,), DENSE, dtype=torch.int32, device=device)
    unused_support = torch.zeros(rows, config.num_attention_heads, blocks, dtype=torch.bool, device=device)
    with torch.inference_mode():
        for r, prompt in enumerate(prompts):
            n, index = len(prompt), torch.arange(len(prompt), device=device)
            group = PrefillGroup(0, n, 1, index, table[r:r + 1, :-(-n // PAGE_SIZE)])
            batch = PrefillBatch(index, slots(r, range(n)), [group], torch.tensor([n - 1], device=device))
            logits[r].append(model.prefill(torch.tensor(prompt, device=device), batch, cache, num_steps=num_steps,
                                           state=state(range(n)))[0])
        positions = [len(p) for p in prompts]
        for _ in range(max_new_tokens - 1):
            step = DecodeBatch(positions=torch.tensor(positions, device=device),
                               seq_lens=torch.tensor(positions, dtype=torch.int32, device=device) + 1,
                               page_table=table.int(),
                               slot_mapping=torch.cat([slots(r, [p]) for r, p in enumerate(positions)]),
                               tags=torch.tensor([r * config.max_position_embeddings + p
                                                  for r, p in enumerate(positions)], device=device))
            tokens = torch.stack([row[-1].argmax() for row in logits])
            ran = torch.zeros(rows, dtype=torch.int32, device=device)
            inputs = state(positions)
            sync(device)
            start = time.perf_counter()
            out = model.decode_step(tokens, step, cache, num_steps=num_steps, state=inputs,
                                    attention=attention, dense_modes=dense_modes, unused_support=unused_support,
                                    wise=wise, adaptive=adaptive, depths=ran, regroup=regroup)
            if step_times is not None:
                sync(device)
                step_times.append(time.perf_counter() - start)
            for r in range(rows):
                logits[r].append(out[r])
                if depths is not None:
                    depths[r].append(int(ran[r]))
            positions = [p + 1 for p in positions]
    logits = [torch.stack(row).float() for row in logits]
    return [row.argmax(-1).tolist() for row in logits], [row.cpu().numpy() for row in logits], wise


def jax_generate(params: jax_huginn.HuginnParams, config: ModelConfig, prompts: list[list[int]], *,
                 max_new_tokens: int, num_steps: int, seed: int = 0, wise_config: WiseConfig | None = None,
                 kernel: str = "reference", adaptive: AdaptiveDepth | None = None,
                 depths: list[list[int]] | None = None, pages: int | None = None, scan_loops: bool = True):
    """`torch_generate` in JAX: (tokens per prompt, logits float32[max_new_tokens, vocab] per
    prompt, the WiseState or None); adaptive, depths and pages as there. A prompt is padded to
    whole pages for its prefill. scan_loops: `wise_jax.huginn.decode_step`'s."""
    rows, pages = len(prompts), _pages(prompts, max_new_tokens, pages)
    dtype = params.wte.dtype
    cache = kvc.create(config, batch=rows, max_pages=pages, num_pages=rows * pages, page_size=PAGE_SIZE,
                       dtype=dtype, planes=num_planes(config, num_steps))
    logits = [[] for _ in prompts]
    for r, prompt in enumerate(prompts):
        padded = np.zeros(-(-len(prompt) // PAGE_SIZE) * PAGE_SIZE, np.int32)
        padded[:len(prompt)] = prompt
        out, k, v = jax_huginn.prefill(params, config, jnp.asarray(padded), jnp.int32(len(prompt)),
                                       jnp.asarray(initial_state(config, np.arange(len(padded)), seed), dtype),
                                       num_steps=num_steps)
        cache = kvc.insert(cache, k, v, jnp.int32(len(prompt)), jnp.int32(r))
        logits[r].append(np.asarray(out, np.float32))
    wise = None if wise_config is None else jax_ws.create(
        wise_config, slots=rows, layers=config.loop_layers, heads=config.num_attention_heads,
        max_blocks=_blocks(pages, wise_config))
    positions = [len(p) for p in prompts]
    for _ in range(max_new_tokens - 1):
        state = jnp.asarray(np.concatenate([initial_state(config, [p], seed) for p in positions]), dtype)
        tokens = jnp.asarray([int(row[-1].argmax()) for row in logits], jnp.int32)
        out, cache, wise, *ran = jax_huginn.decode_step(params, config, cache, tokens, state,
                                                        jnp.arange(rows, dtype=jnp.int32), num_steps=num_steps,
                                                        kernel=kernel, wise_config=wise_config, wise_state=wise,
                                                        adaptive=adaptive, scan_loops=scan_loops)
        out = np.asarray(out, np.float32)
        for r in range(rows):
            logits[r].append(out[r])
            if depths is not None:
                depths[r].append(int(ran[0][r]))
        positions = [p + 1 for p in positions]
    if bool(cache.overflowed):
        raise RuntimeError(f"the cache of {rows * pages} pages overflowed")
    logits = [np.stack(row) for row in logits]
    return [row.argmax(-1).tolist() for row in logits], logits, wise
