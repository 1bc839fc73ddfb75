"""The Ouro recurrent-depth decoder in PyTorch, token-major.

`num_hidden_layers` weight-shared layers run `total_ut_steps` times (loops). Each layer uses
sandwich RMSNorm; after each loop `model.norm` feeds the next loop, the head and the
early-exit gate. The q/k/v and gate/up projections are stored fused (`qkv_proj`,
`gate_up_proj`); `from_tensors` fuses the HF checkpoint tensors and `to_checkpoint_tensors`
splits them back, so the HF names stay the checkpoint format.

Every entry point runs `run_tokens` over flat tokens `[n, hidden]` with an attention context
that stores each plane's K/V and attends:
- `forward`: full-sequence logits of `[batch, seq]` ids (the ground truth; no cache),
- `prefill`: chunks of prompts against the paged cache (chunked prefill, dense; grouped SDPA
  or one packed varlen call per plane),
- `decode_step`: one token per row against the paged cache, optionally with WISE.
With `early_exit_threshold` < 1 each token's logits are its exit loop's (`wise_torch.early_exit`):
`forward` and `prefill` run every loop, `decode_step` stops a row after its exit loop.
The junctions (residual + RMSNorm, RoPE + K/V store, SwiGLU) are the fused ops of
`wise_torch.layers`; logits are float32. One rank's shard of a tensor-parallel model
(`wise_torch.parallel`) runs the same code at its local heads and all-reduces the o_proj and
down_proj outputs.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wise_core.model_config import ModelConfig
from wise_core.selection import Custom, SelectionContext
from wise_core.wise_config import WiseConfig
from wise_torch.attention import prefill_attention
from wise_torch.early_exit import ExitState
from wise_torch.kv_cache import DecodeBatch, KVPlane, PagedKVCache, PrefillBatch
from wise_torch.layers import add_rms_norm, rms_norm, rope_store_kv, rope_table, silu_mul
from wise_torch.wise_state import WiseState


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.qkv_proj = nn.Linear(config.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)


class OuroModel(nn.Module):
    """The HF `model.` submodule: embeddings, shared layers, final norm, early-exit gate."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)


def exit_probabilities(gate_logits: list[torch.Tensor]) -> torch.Tensor:
    """Per-loop gate logits [..., 1] -> exit probabilities float32[..., loops]:
    p_t = lambda_t * prod_{s<t}(1 - lambda_s), the last loop takes the remaining mass."""
    remaining = torch.ones_like(gate_logits[0][..., 0], dtype=torch.float32)
    probs = []
    for t, gate in enumerate(gate_logits):
        lam = torch.sigmoid(gate[..., 0].float())
        if t < len(gate_logits) - 1:
            probs.append(lam * remaining)
            remaining = remaining * (1.0 - lam)
        else:
            probs.append(remaining)
    return torch.stack(probs, dim=-1)


def logits_fp32(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h: [n, hidden] @ weight[vocab, hidden]^T -> float32[n, vocab], accumulated in fp32 and
    never rounded to a 16-bit dtype."""
    if h.dtype == torch.float32:
        return F.linear(h, weight.float())
    if h.is_cuda:
        return torch.mm(h, weight.t(), out_dtype=torch.float32)
    return F.linear(h.float(), weight.float())


# -- attention contexts: store a plane's K/V, then attend ---------------------------------------
class SequenceContext:
    """Causal attention over whole `[batch, seq]` sequences without a cache: each plane's K/V
    goes to one scratch plane, reused by every layer."""

    def __init__(self, config: ModelConfig, batch: int, seq: int, dtype: torch.dtype, device):
        self.batch, self.seq = batch, seq
        self.positions = torch.arange(seq, device=device).repeat(batch)
        self.slot_mapping = torch.arange(batch * seq, device=device)
        shape = (batch, seq, config.num_key_value_heads, config.head_dim)
        self.k, self.v = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)

    def planes(self, loop: int, layer: int) -> KVPlane:
        return KVPlane(self.k, self.v)

    def begin_loop(self, loop: int) -> None:
        pass

    def end_loop(self, loop: int) -> None:
        pass

    def attend(self, q: torch.Tensor, loop: int, layer: int) -> torch.Tensor:
        out = prefill_attention(q.view(self.batch, self.seq, *q.shape[1:]), self.k, self.v)
        return out.reshape(q.shape)


class PagedContext:
    """Attention over the paged cache: a batch with `positions` and `slot_mapping` stores each
    (loop, layer) plane's K/V at its slots (an fp8 cache's quantized); the loop hooks do nothing
    (subclasses attend, an fp8 cache's pages read dequantized to the model's dtype)."""

    def __init__(self, num_layers: int, batch, cache: PagedKVCache):
        self.batch, self.cache, self.num_layers = batch, cache, num_layers
        self.positions, self.slot_mapping = batch.positions, batch.slot_mapping

    def planes(self, loop: int, layer: int) -> KVPlane:
        return self.cache.plane(loop * self.num_layers + layer)

    def begin_loop(self, loop: int) -> None:
        pass

    def end_loop(self, loop: int) -> None:
        pass


class PrefillContext(PagedContext):
    """Chunks of prompts (`PrefillBatch`): each chunk's K/V is stored in the paged cache, then
    its queries attend causally to every cached key of their sequence up to themselves.
    attention: None, one SDPA per group of chunks of one (start, length) over K/V gathered from
    the pages; else a varlen prefill attention (`prefill_attention_varlen_reference`'s
    signature) run once per plane over the pool through `batch.varlen`."""

    def __init__(self, config: ModelConfig, batch: PrefillBatch, cache: PagedKVCache,
                 attention: Callable | None = None):
        super().__init__(config.num_hidden_layers, batch, cache)
        if attention is not None and batch.varlen is None:
            raise ValueError("a varlen prefill attention needs the batch's VarlenPrefill (batch.varlen)")
        self.attention = attention

    def attend(self, q: torch.Tensor, loop: int, layer: int) -> torch.Tensor:
        plane = self.planes(loop, layer)
        if self.attention is not None:
            return self.attention(q, plane.k, plane.v, self.batch.varlen, **plane.scales)
        out = torch.empty_like(q)
        for group in self.batch.groups:  # chunks of one (start, length): one attention call
            g, n, keys = group.count, group.length, group.start + group.length
            k, v = plane.gather(group.pages, q.dtype)
            k = k.flatten(1, 2)[:, :keys]            # [g, keys, kv_heads, head_dim]
            v = v.flatten(1, 2)[:, :keys]
            out[group.token_index] = prefill_attention(
                q[group.token_index].view(g, n, *q.shape[1:]), k, v, start=group.start).flatten(0, 1)
        return out


class DecodeContext(PagedContext):
    """One decode step: writes each plane's K/V for the step's tokens, then runs decode
    attention with the modes of the loop (all DENSE without WISE); a loop that does not discover
    calls it with reuse=True (no row selects). `attention` is a prepared `decode_attention`
    (validation off: the engine builds its inputs by construction);
    dense_attention, if given, runs the dense loops instead (`fa4.decode_attention_dense`'s
    signature). verified: a sparse draft step (`WiseState.sparse_draft_modes`): the tags and
    positions (int64[batch] each) of the tokens whose supports every loop attends. exits: the
    rows' early exit; rows that exited are not counted by WISE's reuse loops
    (`WiseState.begin_loop`'s `ran`)."""

    def __init__(self, config: ModelConfig, batch: DecodeBatch, cache: PagedKVCache,
                 wise: WiseState | None, attention: Callable, dense_modes: torch.Tensor,
                 unused_support: torch.Tensor, dense_attention: Callable | None = None,
                 verified: tuple[torch.Tensor, torch.Tensor] | None = None, exits: ExitState | None = None):
        super().__init__(config.num_hidden_layers, batch, cache)
        if verified is not None and wise is None:
            raise ValueError("a sparse draft step (verified supports) needs a WiseState")
        self.wise, self.attention, self.dense_attention = wise, attention, dense_attention
        self.verified, self.exits = verified, exits
        wise_config = wise.config if wise is not None else WiseConfig()
        self.block_size, self.eta = wise_config.block_size, wise_config.eta
        rule = wise_config.selection
        self.context_rule = isinstance(rule, Custom) and rule.context    # reads a SelectionContext
        # The blocks the step's page table covers: the decode step's context bucket.
        self.blocks = batch.page_table.shape[1] * cache.page_size // self.block_size
        self.dense_modes, self.unused_support = dense_modes, unused_support[:, :, :self.blocks]
        self.role, self.modes = "dense", None

    def begin_loop(self, loop: int) -> None:
        if self.verified is not None:
            self.role = "sparse-draft"
            self.modes = self.wise.sparse_draft_modes(loop, self.batch, *self.verified, self.blocks)
        elif self.wise is not None:
            self.role = self.wise.config.depth_role(loop)
            ran = None if self.exits is None else ~self.exits.exited
            self.modes = self.wise.begin_loop(loop, self.batch, self.blocks, ran)

    def end_loop(self, loop: int) -> None:
        if self.wise is not None and self.verified is None:
            self.wise.end_loop(loop, self.batch, self.blocks)

    def attend(self, q: torch.Tensor, loop: int, layer: int) -> torch.Tensor:
        plane = self.planes(loop, layer)
        if self.role == "dense" and self.dense_attention is not None:
            return self.dense_attention(q, plane.k, plane.v, self.batch.page_table, self.batch.seq_lens)
        if self.role == "dense":
            modes, support = self.dense_modes, self.unused_support
        else:
            modes, support = self.modes[layer], self.wise.support_of(layer, self.batch.size, self.blocks)
        context = dict(plane.scales)       # an fp8 plane: the reference reads its pages dequantized
        if self.context_rule and self.role == "discover":
            context["selection_context"] = self.selection_context(q, loop, layer)
        out, _ = self.attention(q, plane.k, plane.v, self.batch.page_table, self.batch.seq_lens, modes, support,
                                block_size=self.block_size, eta=self.eta, reuse=self.role != "discover", **context)
        return out

    def selection_context(self, q: torch.Tensor, loop: int, layer: int) -> SelectionContext:
        """What a Custom(..., context=True) rule reads at (loop, layer): the rows' seq_lens, the
        loop and layer as int32 tensors, the head and block indices (made on q's device by
        kernels, never copied from the host, so a CUDA graph can capture them)."""
        def index(n: int) -> torch.Tensor:
            return torch.arange(n, dtype=torch.int32, device=q.device)

        def scalar(x: int) -> torch.Tensor:
            return torch.full((), x, dtype=torch.int32, device=q.device)

        return SelectionContext(seq_lens=self.batch.seq_lens, loop=scalar(loop), layer=scalar(layer),
                                head=index(q.shape[1]), block=index(self.blocks), block_size=self.block_size)


# -- the model ------------------------------------------------------------------------------------
ROPE_ROWS = 8192   # RoPE rows a model starts with (not max_position_embeddings: 2**24 of them are 8 GiB)


class OuroForCausalLM(nn.Module):
    """Ouro decoder with its LM head. `config` (ModelConfig), `tokenizer` (or None)."""

    def __init__(self, config: ModelConfig, tokenizer=None):
        super().__init__()
        if config.architecture != "ouro":
            raise ValueError(f"OuroForCausalLM runs architecture 'ouro', got {config.architecture!r} (a Huginn "
                             f"model is a wise_torch.huginn.HuginnForCausalLM)")
        self.config = config
        self.tokenizer = tokenizer
        self.model = OuroModel(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        # One rank's shard of a tensor-parallel model (wise_torch.parallel): config holds the
        # local heads and o_proj / down_proj outputs are all-reduced. None: the whole model.
        self.tp = None

    def build_rope_table(self, positions: int | None = None) -> None:
        """The RoPE table float32[positions, head_dim] on the weights' device (None: ROPE_ROWS, at
        most max_position_embeddings; `rope_rows` grows it). A row does not depend on the
        table's length, so a longer table holds the same values."""
        c = self.config
        rows = min(c.max_position_embeddings, ROPE_ROWS if positions is None else positions)
        self.cos_sin = rope_table(rows, c.head_dim, c.rope_theta, device=self.model.embed_tokens.weight.device)

    def rope_rows(self, positions: int) -> None:
        """Make the RoPE table hold `positions` rows (positions <= max_position_embeddings),
        rebuilding it when it is shorter. The engine calls it with max_model_len before it captures
        a graph (a graph keeps the table it was captured with); positions past the table read NaN
        in the fused kernel, never another row."""
        if positions > self.config.max_position_embeddings:
            raise ValueError(f"{positions} positions exceed max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        if self.cos_sin.shape[0] < positions:
            self.build_rope_table(positions)

    def planes(self, num_steps: int) -> int:
        """K/V planes of an engine's paged cache for steps of `num_steps` loops, one per (loop,
        layer). An Ouro step runs every loop: num_steps must be num_loops."""
        if num_steps != self.config.num_loops:
            raise ValueError(f"an Ouro model runs its {self.config.num_loops} loops every step, got "
                             f"num_steps={num_steps!r} (num_steps sets a Huginn model's core iterations)")
        return num_steps * self.config.num_hidden_layers

    def step_inputs(self, num_steps: int, positions: int) -> dict:
        """The model's own keyword inputs of `prefill` and `decode_step` in an engine of
        `num_steps` loops and `positions` positions (`HuginnForCausalLM.step_inputs`): none."""
        return {}

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [n, hidden] (normed output of the last loop) -> float32[n, vocab]."""
        return logits_fp32(h, self.head_weight)

    def exit_state(self, rows: int, *, keep_kv: bool, device) -> ExitState | None:
        """The early exit of `rows` token rows (`wise_torch.early_exit`); None when every loop
        runs (early_exit_threshold 1)."""
        c = self.config
        if c.early_exit_threshold >= 1.0:
            return None
        return ExitState(rows, c.num_loops, c.early_exit_threshold, keep_kv=keep_kv, device=device)

    def run_tokens(self, ids: torch.Tensor, ctx, gates: list | None = None, exits: ExitState | None = None
                   ) -> torch.Tensor:
        """Every loop over flat tokens ids int64[n] -> the normed hidden [n, hidden] of the last
        loop, or with `exits` of each token's exit loop. With `gates`, appends each loop's
        early-exit gate logits [n, 1]."""
        h = self.run_loops(self.model.embed_tokens(ids), ctx, range(self.config.num_loops), gates, exits)
        return h if exits is None else exits.output(h)

    def run_loops(self, h: torch.Tensor, ctx, loops: range, gates: list | None = None,
                  exits: ExitState | None = None) -> torch.Tensor:
        """The consecutive loops `loops` over flat hidden states h [n, hidden] (the embeddings
        before loop 0, else the normed output of loop loops.start - 1) -> the normed output of
        the range's last loop. Speculative decoding runs a decode step's loops in two ranges.
        exits: the rows' early exit (`ExitState`), updated after each loop; the caller reads
        the exited rows' states from it."""
        c, layers, norm, tp = self.config, self.model.layers, self.model.norm, self.tp
        eps, heads, kv_heads, head_dim = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = rms_norm(h, layers[0].input_layernorm.weight, eps)
        for loop in loops:
            ctx.begin_loop(loop)
            for i, layer in enumerate(layers):
                attn, mlp = layer.self_attn, layer.mlp
                plane = ctx.planes(loop, i)
                q = rope_store_kv(attn.qkv_proj(x), ctx.positions, self.cos_sin, plane.k, plane.v,
                                  ctx.slot_mapping, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                  k_scale=plane.k_scale, v_scale=plane.v_scale)
                if exits is not None:
                    exits.store_kv(loop, plane, ctx.planes(loop - 1, i), ctx.slot_mapping)
                a = attn.o_proj(ctx.attend(q, loop, i).flatten(1))
                if tp is not None:
                    tp.all_reduce(a)          # the partial sums of the ranks' heads
                h, x = add_rms_norm(a, h, layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight, eps)
                last_layer = i == len(layers) - 1
                if not last_layer:
                    following = layers[i + 1].input_layernorm.weight
                else:
                    following = None if loop == loops[-1] else layers[0].input_layernorm.weight
                m = mlp(x)
                if tp is not None:
                    tp.all_reduce(m)          # the partial sums of the ranks' MLP columns
                h, x = add_rms_norm(m, h, layer.post_attention_layernorm_2.weight, following, eps,
                                    final_weight=norm.weight if last_layer else None)
            ctx.end_loop(loop)
            if exits is not None:
                exits.end_loop(loop, h, self.model.early_exit_gate)
            if gates is not None:
                gates.append(self.model.early_exit_gate(h))
        return h

    @staticmethod
    def _check_ids(input_ids: torch.Tensor, dims: int) -> None:
        if input_ids.dim() != dims or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor with {dims} dims, "
                             f"got {input_ids.dtype}{list(input_ids.shape)}")

    def forward(self, input_ids: torch.Tensor, *, return_exit_probs: bool = False):
        """input_ids: int64[batch, seq] -> logits float32[batch, seq, vocab] of each token's exit
        loop (every loop runs; the last loop's when early_exit_threshold is 1); with
        return_exit_probs also the per-loop exit probabilities float32[batch, seq, loops]."""
        self._check_ids(input_ids, 2)
        if self.tp is not None:
            raise RuntimeError("this model is one rank's shard of a tensor-parallel LLM: it runs only inside "
                               "that engine's steps (the other ranks must join every call)")
        batch, seq = input_ids.shape
        if seq > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {seq} tokens exceeds max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        self.rope_rows(seq)
        bad = input_ids[(input_ids < 0) | (input_ids >= self.config.vocab_size)]
        if bad.numel():  # one host sync: forward is the full-sequence ground truth, not the hot path
            raise ValueError(f"input_ids hold ids {sorted(set(bad.tolist()))[:5]} outside the vocabulary "
                             f"(size {self.config.vocab_size})")
        ctx = SequenceContext(self.config, batch, seq, self.head_weight.dtype, input_ids.device)
        gates = [] if return_exit_probs else None
        h = self.run_tokens(input_ids.flatten().long(), ctx, gates,
                            self.exit_state(batch * seq, keep_kv=False, device=input_ids.device))
        logits = self.logits(h).view(batch, seq, -1)
        if not return_exit_probs:
            return logits
        return logits, exit_probabilities([g.view(batch, seq, 1) for g in gates])

    def prefill(self, ids: torch.Tensor, batch: PrefillBatch, cache: PagedKVCache, *,
                attention: Callable | None = None) -> torch.Tensor:
        """Dense pass over prompt chunks (ids int64[n], flat), storing K/V of every plane.
        Returns the logits float32[len(batch.logit_index), vocab] at the tokens `logit_index` names,
        each of its token's exit loop (every loop runs for every token); with batch.score_index,
        (those, the logits float32[len(score_index), vocab] at its tokens), each its own product,
        so the first are those of a batch without score_index.
        attention: `PrefillContext`'s (None: grouped SDPA; else a varlen one over batch.varlen)."""
        self._check_ids(ids, 1)
        h = self.run_tokens(ids, PrefillContext(self.config, batch, cache, attention),
                            exits=self.exit_state(ids.shape[0], keep_kv=False, device=ids.device))
        logits = self.logits(h[batch.logit_index])
        if batch.score_index is None:
            return logits
        return logits, self.logits(h[batch.score_index])

    def decode_step(self, tokens: torch.Tensor, batch: DecodeBatch, cache: PagedKVCache, *,
                    wise: WiseState | None, attention: Callable, dense_modes: torch.Tensor,
                    unused_support: torch.Tensor, dense_attention: Callable | None = None,
                    loops_run: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: int64[batch], the token at each row's position -> logits float32[batch, vocab].
        With `wise`, loops follow its WiseConfig roles; without, every loop is DENSE.
        dense_modes int32[>= batch] (DENSE) and unused_support bool[>= batch, heads, >= blocks]
        are the constant inputs of dense calls. The step attends over batch.page_table's width
        (its context bucket): every row's keys must lie in it. dense_attention: `DecodeContext`'s.
        With early_exit_threshold < 1 a row stops after its exit loop (`wise_torch.early_exit`):
        logits of that loop, its K/V of later loops that loop's; loops_run int64[2], if given,
        gets the loops the real rows (tags >= 0) ran and their count added in place."""
        exits = self.exit_state(batch.size, keep_kv=True, device=tokens.device)
        ctx = DecodeContext(self.config, batch, cache, wise, attention, dense_modes[:batch.size],
                            unused_support[:batch.size], dense_attention, exits=exits)
        logits = self.logits(self.run_tokens(tokens, ctx, exits=exits))
        if loops_run is not None and exits is not None:
            real = batch.tags >= 0
            loops_run += torch.stack([((exits.exit_loop + 1) * real).sum(), real.sum()])
        return logits


# -- loading and export -------------------------------------------------------------------------
_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


def fused_groups(names) -> dict[str, tuple[str, ...]]:
    """The fused weights the HF names among `names` make: fused name (a layer's qkv_proj or
    gate_up_proj) -> its parts in order (only where every part is among `names`)."""
    names = set(names)
    groups = {}
    for name in sorted(names):
        prefix, _, rest = name.partition(".layers.")
        layer, _, leaf = rest.partition(".")
        for fused, parts in _FUSED.items():
            if not rest or leaf != parts[0]:
                continue
            group = tuple(f"{prefix}.layers.{layer}.{part}" for part in parts)
            if names.issuperset(group):
                groups[f"{prefix}.layers.{layer}.{fused}"] = group
    return groups


def fused_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named weights -> the model's state dict: q/k/v and gate/up concatenated (qkv_proj,
    gate_up_proj), every other tensor as it is. Consumes `weights`, so the parts are freed as
    each fused weight is made (host memory stays near one copy of the model)."""
    out = {fused: torch.cat([weights.pop(part) for part in parts])
           for fused, parts in fused_groups(weights).items()}
    out.update((name, weights.pop(name)) for name in list(weights))
    return out


def to_checkpoint_tensors(model: OuroForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights as float32 numpy arrays under the HF checkpoint names."""
    if model.tp is not None:
        raise ValueError("this model is one rank's shard of a tensor-parallel LLM, not the whole model")
    c = model.config
    sizes = {"self_attn.qkv_proj.weight": [c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim,
                                           c.num_key_value_heads * c.head_dim],
             "mlp.gate_up_proj.weight": [c.intermediate_size, c.intermediate_size]}
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu", torch.float32)
        layer, _, leaf = name.partition(".layers.")[2].partition(".")
        if name.startswith("model.layers.") and leaf in _FUSED:
            for part, piece in zip(_FUSED[leaf], t.split(sizes[leaf])):
                out[f"model.layers.{layer}.{part}"] = piece.contiguous().numpy()
        else:
            out[name] = t.numpy()
    return out
