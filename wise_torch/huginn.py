"""The Huginn recurrent-depth decoder (huginn-0125) in PyTorch, token-major: the forward of
`wise_core.huginn_reference`.

A prelude embeds the tokens, a core block iterated num_steps times refines a recurrent state
that each iteration mixes with the embedded input through the adapter, a coda and the tied head
read it out. Layers are sandwich blocks (norm after each residual add).

The model holds the checkpoint's tensors with two changes made at load (`huginn_state_dict`):
q's and k's rows of each head are reordered from the released interleaved RoPE pairs (2j,
2j + 1) to split halves (j, j + head_dim / 2), so the shared split-half `rope_store_kv` applies
the released rotation (q . k is unchanged: both are reordered alike; v and the output
projection are not touched); and `qk_bias` becomes the bias of the fused qkv projection (zero
on v), added before RoPE as released.

K/V planes as `wise_core.huginn_reference.plane_index` lays them out. `prefill` and
`decode_step` run over the paged cache (`wise_torch.kv_cache`, `num_planes(config, max_steps)`
planes) with Ouro's attention contexts, each plane index given as the loop of a one-layer
context. `decode_step` runs WISE over the core iterations with Ouro's `WiseState`
(`HuginnDecodeContext`): core iteration `step` and core layer n are the state's (loop, layer),
so `WiseConfig` depths index core iterations; the prelude and the coda attend densely. The
serving engine (`wise_torch.LLM`) runs the model through `planes` and `step_inputs`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import torch
from torch import nn

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.checkpoint import huginn_layers, validate_tensors
from wise_core.huginn_reference import initial_state, num_planes, plane_index
from wise_core.model_config import ModelConfig
from wise_torch.kv_cache import DecodeBatch, KVPlane, PagedKVCache, PrefillBatch
from wise_torch.layers import rms_norm, rope_store_kv, rope_table, silu_mul
from wise_torch.model import ROPE_ROWS, DecodeContext, PrefillContext, SequenceContext, logits_fp32
from wise_torch.wise_state import WiseState


class HuginnDecodeContext(DecodeContext):
    """`DecodeContext` over Huginn's planes: a layer attends plane `plane` (`plane_index`), and a
    core plane's WISE layer is its core layer. `begin_loop(step)` sets core iteration step's
    roles, `end_loop(step)` tags its supports and returns to dense, so the prelude (before the
    first iteration) and the coda (after the last) attend densely."""

    def __init__(self, config: ModelConfig, batch: DecodeBatch, cache: PagedKVCache, wise: WiseState | None,
                 attention, dense_modes: torch.Tensor, unused_support: torch.Tensor, dense_attention=None):
        super().__init__(config, batch, cache, wise, attention, dense_modes, unused_support, dense_attention)
        self.first_core, self.core_layers = plane_index(config, "core_block", 0), config.n_layers_in_recurrent_block

    def planes(self, plane: int, layer: int = 0) -> KVPlane:
        return self.cache.plane(plane)

    def end_loop(self, step: int) -> None:
        super().end_loop(step)
        self.role = "dense"

    def attend(self, q: torch.Tensor, plane: int, layer: int = 0) -> torch.Tensor:
        return super().attend(q, plane, (plane - self.first_core) % self.core_layers)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        self.qkv = nn.Linear(h, 3 * h, bias=config.qk_bias)
        self.proj = nn.Linear(h, h, bias=False)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(silu_mul(self.fc(x)))


class SandwichBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn, self.mlp = Attention(config), MLP(config)
        for n in range(1, 5):
            self.register_parameter(f"norm_{n}", nn.Parameter(torch.ones(config.hidden_size)))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, h)
        self.prelude = nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_prelude))
        self.adapter = nn.Linear(2 * h, h, bias=False)
        self.core_block = nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_recurrent_block))
        self.coda = nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_coda))
        self.ln_f = nn.Parameter(torch.ones(h))


class HuginnForCausalLM(nn.Module):
    """Huginn decoder with its head (tied to wte unless the config unties it)."""

    def __init__(self, config: ModelConfig, tokenizer=None):
        super().__init__()
        if config.architecture != "huginn":
            raise ValueError(f"HuginnForCausalLM needs a Huginn config, got architecture {config.architecture!r}")
        self.config, self.tokenizer = config, tokenizer
        self.transformer = Transformer(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def build_rope_table(self, positions: int | None = None) -> None:
        """The split-half RoPE table float32[positions, head_dim] (None: ROPE_ROWS, at most
        max_position_embeddings): the released float32 angles."""
        c = self.config
        rows = min(c.max_position_embeddings, ROPE_ROWS if positions is None else positions)
        self.cos_sin = rope_table(rows, c.head_dim, c.rope_theta, device=self.transformer.wte.weight.device)

    def rope_rows(self, positions: int) -> None:
        if positions > self.config.max_position_embeddings:
            raise ValueError(f"{positions} positions exceed max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        if self.cos_sin.shape[0] < positions:
            self.build_rope_table(positions)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight

    def block(self, layer: SandwichBlock, x: torch.Tensor, ctx, plane: int) -> torch.Tensor:
        """One sandwich block on flat tokens x [n, hidden], its K/V stored in plane `plane`."""
        c = self.config
        eps, heads, head_dim = c.rms_norm_eps, c.num_attention_heads, c.head_dim
        kv = ctx.planes(plane, 0)
        q = rope_store_kv(layer.attn.qkv(rms_norm(x, layer.norm_1, eps)), ctx.positions, self.cos_sin,
                          kv.k, kv.v, ctx.slot_mapping, heads=heads, kv_heads=heads, head_dim=head_dim)
        x = rms_norm(layer.attn.proj(ctx.attend(q, plane, 0).flatten(1)) + x, layer.norm_2, eps)
        return rms_norm(layer.mlp(rms_norm(x, layer.norm_3, eps)) + x, layer.norm_4, eps)

    def run_tokens(self, ids: torch.Tensor, state: torch.Tensor, ctx, num_steps: int,
                   adaptive: AdaptiveDepth | None = None, depths: torch.Tensor | None = None) -> torch.Tensor:
        """Flat tokens ids int64[n] from initial state [n, hidden] -> the coda's normed output
        [n, hidden]. adaptive: per-token exits of a decode step (`AdaptiveDepth`; see
        `decode_step`), the iterations each row ran written to depths int32[n]."""
        self.check_inputs(ids, state, num_steps)
        embedded = self.run_prelude(ids, ctx)
        x = state
        exited = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        last = torch.full((ids.shape[0],), num_steps - 1, dtype=torch.int64, device=ids.device)
        previous = None
        for step in range(num_steps):
            new = self.run_iteration(x, embedded, ctx, step)
            if adaptive is None:
                x = new
                continue
            x = torch.where(exited[:, None], x, new)          # rows that exited ride along, held
            self.hold_exited(ctx, exited, last, step)
            if adaptive.min_steps <= step < num_steps - 1:
                kl, log_p = self.exit_kl(x, ctx, previous)
                now = ~exited & (kl < adaptive.threshold)
                last = torch.where(now, step, last)
                exited, previous = exited | now, log_p
        if depths is not None:
            depths.copy_(last + 1)
        return self.readout(x, ctx)

    def run_regrouped(self, ids: torch.Tensor, state: torch.Tensor, ctx: HuginnDecodeContext, context: Callable,
                      num_steps: int, adaptive: AdaptiveDepth, depths: torch.Tensor) -> torch.Tensor:
        """`run_tokens` of a decode step with adaptive depth, regrouped: after each checked
        iteration the rows that exit leave the group and only the rows still running run the
        later iterations (gathered, so dynamic shapes: eager only). ctx: the step's context
        over every row; context(rows int64[m]) -> its context over those rows. Each row computes
        what it computes riding along (a row's computation does not involve the others'), and
        an exited row's later iterations' K/V are its exit iteration's, written once after the
        last iteration ("latest-m4"), so the tokens and depths are `run_tokens`'s."""
        self.check_inputs(ids, state, num_steps)
        embedded = self.run_prelude(ids, ctx)
        x = state.clone()
        last = torch.full((ids.shape[0],), num_steps - 1, dtype=torch.int64, device=ids.device)
        rows = torch.arange(ids.shape[0], device=ids.device)      # the rows running
        group, group_x, group_embedded, previous = ctx, x, embedded, None
        for step in range(num_steps):
            group_x = self.run_iteration(group_x, group_embedded, group, step)
            x[rows] = group_x
            if not adaptive.min_steps <= step < num_steps - 1:
                continue
            kl, previous = self.exit_kl(group_x, group, previous)
            stay = ~(kl < adaptive.threshold)   # NaN stays, as riding along
            if bool(stay.all()):
                continue
            last[rows[~stay]] = step
            rows, group_x, group_embedded, previous = rows[stay], group_x[stay], group_embedded[stay], previous[stay]
            if rows.numel() == 0:
                break
            group = context(rows)
        for step in range(1, num_steps):
            self.hold_exited(ctx, last < step, last, step)
        depths.copy_(last + 1)
        return self.readout(x, ctx)

    def run_prelude(self, ids: torch.Tensor, ctx) -> torch.Tensor:
        """Flat tokens ids int64[n] -> their scaled embeddings through the prelude [n, hidden]."""
        c, t = self.config, self.transformer
        x = t.wte(ids) * c.embed_scale
        for n, layer in enumerate(t.prelude):
            x = self.block(layer, x, ctx, plane_index(c, "prelude", n))
        return x

    def run_iteration(self, x: torch.Tensor, embedded: torch.Tensor, ctx, step: int) -> torch.Tensor:
        """Core iteration `step` of state x [n, hidden]: the adapter over [x, embedded], then the
        core block's layers, between ctx's begin_loop and end_loop."""
        c, t = self.config, self.transformer
        ctx.begin_loop(step)
        x = t.adapter(torch.cat([x, embedded], dim=-1))
        for n, layer in enumerate(t.core_block):
            x = self.block(layer, x, ctx, plane_index(c, "core_block", n, step))
        ctx.end_loop(step)
        return x

    def exit_kl(self, x: torch.Tensor, ctx, previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The adaptive exit criterion at state x [n, hidden]: (KL(p_previous || p) float32[n], log p
        float32[n, vocab]) of the readout's next-token distribution p, against the previous checked
        iteration's log-probabilities `previous` (None: the uniform distribution)."""
        log_p = torch.log_softmax(logits_fp32(self.readout(x, ctx), self.head_weight), dim=-1)
        if previous is None:
            previous = torch.full_like(log_p, -math.log(log_p.shape[-1]))
        return (previous.exp() * (previous - log_p)).sum(-1), log_p

    def check_inputs(self, ids: torch.Tensor, state: torch.Tensor, num_steps: int) -> None:
        self.check_steps(num_steps)
        if tuple(state.shape) != (ids.shape[0], self.config.hidden_size):
            raise ValueError(f"state must be [{ids.shape[0]}, {self.config.hidden_size}], got {list(state.shape)}")

    def readout(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """The coda over the core block's state x [n, hidden] -> its normed output [n, hidden]."""
        c, t = self.config, self.transformer
        x = rms_norm(x, t.ln_f, c.rms_norm_eps)
        for n, layer in enumerate(t.coda):
            x = self.block(layer, x, ctx, plane_index(c, "coda", n))
        return rms_norm(x, t.ln_f, c.rms_norm_eps)

    def hold_exited(self, ctx, exited: torch.Tensor, last: torch.Tensor, step: int) -> None:
        """The released "latest-m4" lookup, written ahead: iteration `step`'s K/V of each row that
        exited (after iteration last[row] < step) becomes its iteration-last K/V, at its slot."""
        c = self.config
        for n in range(c.n_layers_in_recurrent_block):
            source = plane_index(c, "core_block", n, 0) + last * c.n_layers_in_recurrent_block   # int64[rows]
            target = plane_index(c, "core_block", n, step)
            for pool in (ctx.cache.k, ctx.cache.v):
                flat = pool.view(pool.shape[0], -1, *pool.shape[3:])          # [planes, slots, kv_heads, head_dim]
                held = flat[source, ctx.slot_mapping]
                flat[target, ctx.slot_mapping] = torch.where(exited[:, None, None], held, flat[target, ctx.slot_mapping])

    def paged(self, ctx, cache: PagedKVCache, num_steps: int):
        """ctx with each plane index taken as its loop (see the module docstring), after checking
        that the cache holds num_steps iterations' planes."""
        if cache.quantized:
            raise ValueError("an fp8 K/V cache (kv_cache_dtype='fp8') is not implemented for Huginn models yet")
        need = num_planes(self.config, num_steps)
        if cache.k.shape[0] < need:
            raise ValueError(f"the cache holds {cache.k.shape[0]} planes; {num_steps} core iterations need {need}")
        ctx.num_layers = 1
        return ctx

    def prefill(self, ids: torch.Tensor, batch: PrefillBatch, cache: PagedKVCache, *, num_steps: int,
                state: torch.Tensor | None = None, state_table: torch.Tensor | None = None,
                attention=None) -> torch.Tensor:
        """Dense pass over prompt chunks (ids int64[n], flat), storing the K/V of every plane, from
        the initial state: `state` [n, hidden], or the rows of `state_table` [positions, hidden] at
        batch.positions (`step_inputs`). attention: `PrefillContext`'s. Returns logits
        float32[len(batch.logit_index), vocab]; with batch.score_index, (those, the logits at its
        tokens), as `OuroForCausalLM.prefill`."""
        ctx = self.paged(PrefillContext(self.config, batch, cache, attention), cache, num_steps)
        h = self.run_tokens(ids, self.state_at(batch.positions, state, state_table), ctx, num_steps)
        logits = logits_fp32(h[batch.logit_index], self.head_weight)
        return logits if batch.score_index is None else (logits, logits_fp32(h[batch.score_index], self.head_weight))

    def decode_step(self, tokens: torch.Tensor, batch: DecodeBatch, cache: PagedKVCache, *, num_steps: int,
                    attention, dense_modes: torch.Tensor, unused_support: torch.Tensor,
                    wise: WiseState | None = None, state: torch.Tensor | None = None,
                    state_table: torch.Tensor | None = None, dense_attention=None,
                    adaptive: AdaptiveDepth | None = None, depths: torch.Tensor | None = None,
                    loops_run: torch.Tensor | None = None, regroup: bool = False) -> torch.Tensor:
        """tokens int64[batch] at each row's position, from the initial state `state` [batch,
        hidden] or the rows of `state_table` at batch.positions -> logits float32[batch, vocab]
        (`OuroForCausalLM.decode_step`'s other inputs). wise: WISE over the core iterations (a
        `WiseState` of this config: its depths index core iterations, each < num_steps); None:
        every plane dense. adaptive: per-token adaptive depth (`wise_core.huginn_reference`'s):
        after each checked iteration the coda and head read every row's state, a row exits on the
        KL criterion and rides along held (its state frozen, its later iterations' K/V its exit
        iteration's); static shapes, every iteration runs (graph-safe). With WISE a row that
        exited still runs the later iterations' discovery and reuse attention (on its held state,
        outputs discarded; WiseState counts it). regroup (with adaptive, without WISE, eager
        only): the rows still running are gathered after each checked iteration and only they
        run the later ones (`run_regrouped`: the same tokens and depths, dynamic shapes).
        depths: int32[batch], written with the iterations each row ran. loops_run int64[2], if
        given, gets the iterations the real rows (tags >= 0) ran and their count added in place
        (`OuroForCausalLM.decode_step`'s)."""
        if regroup and (adaptive is None or wise is not None):
            raise ValueError("regroup runs adaptive depth (adaptive=) without WISE (wise=None)")
        if regroup and tokens.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("regroup gathers rows (dynamic shapes): it cannot run in a CUDA graph")
        if wise is not None:
            wise.config.validate_for(num_steps, f"num_steps={num_steps} core iterations")
            if wise.num_layers != self.config.n_layers_in_recurrent_block:
                raise ValueError(f"the WISE state holds {wise.num_layers} layers; this model's core block has "
                                 f"{self.config.n_layers_in_recurrent_block}")
        ctx = HuginnDecodeContext(self.config, batch, cache, wise, attention, dense_modes[:batch.size],
                                  unused_support[:batch.size], dense_attention)
        if (loops_run is not None or regroup) and depths is None:
            depths = torch.empty(batch.size, dtype=torch.int32, device=tokens.device)
        state = self.state_at(batch.positions, state, state_table)
        if regroup:
            def context(rows: torch.Tensor) -> HuginnDecodeContext:
                sub = DecodeBatch(**{f.name: getattr(batch, f.name)[rows] for f in dataclasses.fields(batch)})
                return self.paged(HuginnDecodeContext(self.config, sub, cache, None, attention, ctx.dense_modes[rows],
                                                      ctx.unused_support[rows], dense_attention), cache, num_steps)
            h = self.run_regrouped(tokens, state, self.paged(ctx, cache, num_steps), context, num_steps, adaptive,
                                   depths)
        else:
            h = self.run_tokens(tokens, state, self.paged(ctx, cache, num_steps), num_steps, adaptive, depths)
        if loops_run is not None:
            real = batch.tags >= 0
            loops_run += torch.stack([(depths * real).sum(), real.sum()])
        return logits_fp32(h, self.head_weight)

    def state_at(self, positions: torch.Tensor, state: torch.Tensor | None,
                 state_table: torch.Tensor | None) -> torch.Tensor:
        """The initial state of tokens at `positions` int64[n]: `state` [n, hidden] as given, or
        state_table's rows (gathered on the device: no host sync) -> [n, hidden] in the model's dtype."""
        if (state is None) == (state_table is None):
            raise ValueError("pass the initial state as exactly one of state and state_table")
        if state_table is not None:
            state = state_table.index_select(0, positions)
        return state.to(self.head_weight.dtype)

    # -- the engine's interface (`wise_torch.engine.model_runner`) -------------------------------
    tp = None   # no tensor parallelism (`OuroForCausalLM.tp`)

    @staticmethod
    def check_steps(num_steps) -> None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(f"num_steps must be a non-negative integer, got {num_steps!r}")

    def planes(self, num_steps: int) -> int:
        """K/V planes of an engine's paged cache for `num_steps` core iterations (`num_planes`)."""
        self.check_steps(num_steps)
        return num_planes(self.config, num_steps)

    def step_inputs(self, num_steps: int, positions: int, seed: int = 0) -> dict:
        """The keyword inputs of `prefill` and `decode_step` in an engine of `num_steps` core
        iterations and `positions` positions: num_steps and the state_table [positions, hidden]
        of the seeded initial state of every position (`initial_state`), so a token's state
        depends on its position and seed alone (a recomputed or re-batched token gets the same)
        and a decode step reads it on the device from a static buffer (CUDA-graph safe)."""
        self.check_steps(num_steps)
        return dict(num_steps=num_steps, state_table=self.initial_state(1, range(positions), seed))

    def initial_state(self, batch: int, positions: range, seed: int) -> torch.Tensor:
        """`wise_core.huginn_reference.initial_state` for `batch` rows at `positions` -> [batch *
        len(positions), hidden] in the model's dtype (every row draws the same state)."""
        state = torch.from_numpy(initial_state(self.config, np.asarray(positions), seed))
        w = self.transformer.wte.weight
        return state.to(device=w.device, dtype=w.dtype).repeat(batch, 1)

    def forward(self, input_ids: torch.Tensor, *, num_steps: int | None = None, seed: int = 0,
                state: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: int64[batch, seq] -> logits float32[batch, seq, vocab], the core block run
        num_steps times (default total_ut_steps) from `state` [batch, seq, hidden] (None: the
        seeded initial state of each position)."""
        c = self.config
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype}"
                             f"{list(input_ids.shape)}")
        num_steps = c.total_ut_steps if num_steps is None else num_steps
        batch, seq = input_ids.shape
        self.rope_rows(seq)
        bad = input_ids[(input_ids < 0) | (input_ids >= c.vocab_size)]
        if bad.numel():
            raise ValueError(f"input_ids hold ids {sorted(set(bad.tolist()))[:5]} outside the vocabulary "
                             f"(size {c.vocab_size})")
        if state is None:
            state = self.initial_state(batch, range(seq), seed)
        elif tuple(state.shape) != (batch, seq, c.hidden_size):
            raise ValueError(f"state must be [{batch}, {seq}, {c.hidden_size}], got {list(state.shape)}")
        else:
            state = state.to(device=input_ids.device, dtype=self.head_weight.dtype).reshape(batch * seq, -1)
        ctx = SequenceContext(c, batch, seq, self.head_weight.dtype, input_ids.device)
        h = self.run_tokens(input_ids.flatten().long(), state, ctx, num_steps)
        return logits_fp32(h, self.head_weight).view(batch, seq, -1)


def split_half_rows(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows [heads * head_dim, ...] of one projection, each head's reordered from interleaved
    pairs (2j, 2j + 1) to split halves (j, j + head_dim / 2)."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return w.reshape(heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


def huginn_state_dict(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named checkpoint tensors -> the model's state dict (see the module docstring)."""
    heads, d, h = config.num_attention_heads, config.head_dim, config.hidden_size
    out = {"transformer.wte.weight": tensors["transformer.wte.weight"],
           "transformer.adapter.weight": tensors["transformer.adapter.weight"],
           "transformer.ln_f": tensors["transformer.ln_f.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = tensors["lm_head.weight"]
    for stack, n in huginn_layers(config):
        src, dst = f"transformer.{stack}.{n}.", f"transformer.{stack}.{n}."
        q, k, v = tensors[src + "attn.Wqkv.weight"].split(h)
        out[dst + "attn.qkv.weight"] = torch.cat([split_half_rows(q, heads, d), split_half_rows(k, heads, d), v])
        if config.qk_bias:
            bias = tensors[src + "attn.qk_bias"].reshape(2, h)
            out[dst + "attn.qkv.bias"] = torch.cat([split_half_rows(bias[0], heads, d),
                                                    split_half_rows(bias[1], heads, d), torch.zeros_like(bias[0])])
        for name in ("attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"):
            out[dst + name] = tensors[src + name]
        for i in range(1, 5):
            out[dst + f"norm_{i}"] = tensors[src + f"norm_{i}.weight"]
    return out


def huginn_from_tensors(config: ModelConfig, tensors: dict, *, tokenizer=None, dtype=torch.float32,
                        device: torch.device | str = "cpu") -> HuginnForCausalLM:
    """An eval-mode Huginn model from HF-named numpy arrays or torch tensors (validated against
    `config`; a tied lm_head and freqs_cis are dropped)."""
    validate_tensors(config, tensors)
    weights = {name: (t if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t, np.float32)))
               .to(device=device, dtype=dtype) for name, t in tensors.items()}
    with torch.device("meta"):
        model = HuginnForCausalLM(config, tokenizer)
    model.load_state_dict(huginn_state_dict(config, weights), strict=True, assign=True)
    model.build_rope_table()
    return model.requires_grad_(False).eval()

