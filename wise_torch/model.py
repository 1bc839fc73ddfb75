"""The Ouro recurrent-depth decoder in plain PyTorch.

`num_hidden_layers` weight-shared layers run `total_ut_steps` times (loops). Each layer uses
sandwich RMSNorm; after each loop `model.norm` feeds the next loop, the head and the
early-exit gate. Module and parameter names follow the HF checkpoints, so `state_dict()` keys
are the checkpoint's tensor names.

Three entry points share `run_loop`: `forward` (full-sequence logits, the ground truth),
`prefill` (the same computation, storing every plane's K/V in a paged cache) and `decode_step`
(one token per row against the paged cache, optionally with WISE).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wise_core.config import ModelConfig, WiseConfig
from wise_core.modes import DENSE
from wise_torch.attention import prefill_attention, resolve_kernel
from wise_torch.kv_cache import DecodeBatch, PagedKVCache
from wise_torch.wise_state import WiseState


# -- building blocks --------------------------------------------------------------------------
def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: int64[...] -> cos, sin: float32[..., head_dim] (split-half layout)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; cos, sin: [..., head_dim] (fp32) -> x rotated, in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[..., None, :] + rotated * sin[..., None, :]).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx, loop: int) -> torch.Tensor:
        """x: [..., hidden] ([batch, seq, hidden] or [batch, hidden]) -> [..., hidden]."""
        lead = x.shape[:-1]
        q = apply_rope(self.q_proj(x).view(*lead, self.heads, self.head_dim), ctx.cos, ctx.sin)
        k = apply_rope(self.k_proj(x).view(*lead, self.kv_heads, self.head_dim), ctx.cos, ctx.sin)
        v = self.v_proj(x).view(*lead, self.kv_heads, self.head_dim)
        out = ctx.attend(q, k, v, loop, self.layer_idx)
        return self.o_proj(out.reshape(*lead, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)

    def forward(self, h: torch.Tensor, ctx, loop: int) -> torch.Tensor:
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h), ctx, loop))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class OuroModel(nn.Module):
    """The HF `model.` submodule: embeddings, shared layers, final norm, early-exit gate."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
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


# -- attention contexts -------------------------------------------------------------------------
@dataclasses.dataclass
class SequenceContext:
    """Whole-sequence causal attention; with a cache, also stores K/V of the real tokens.

    cos, sin: float32[seq, head_dim]; token_index: int64[n] (flat batch*seq index of each
    stored token); slots: int64[n] (its flat cache slot).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    num_layers: int
    cache: PagedKVCache | None = None
    token_index: torch.Tensor | None = None
    slots: torch.Tensor | None = None

    def begin_loop(self, loop: int) -> None:
        pass

    def attend(self, q, k, v, loop: int, layer: int) -> torch.Tensor:
        if self.cache is not None:
            flat_k, flat_v = k.flatten(0, 1)[self.token_index], v.flatten(0, 1)[self.token_index]
            self.cache.write(loop * self.num_layers + layer, self.slots, flat_k, flat_v)
        return prefill_attention(q, k, v)


class DecodeContext:
    """One decode step: writes each plane's K/V for the step's tokens, then runs decode attention
    with the modes of the loop (all DENSE without WISE)."""

    def __init__(self, config: ModelConfig, batch: DecodeBatch, cache: PagedKVCache,
                 wise: WiseState | None, kernel: str | Callable):
        if wise is not None and batch.wise_slots is None:
            raise ValueError("decoding with WISE needs DecodeBatch.wise_slots")
        self.batch, self.cache, self.wise = batch, cache, wise
        self.num_layers = config.num_hidden_layers
        self.attention = resolve_kernel(kernel, cache.device) if isinstance(kernel, str) else kernel
        wise_config = wise.config if wise is not None else WiseConfig()
        self.block_size, self.eta = wise_config.block_size, wise_config.eta
        self.cos, self.sin = rope_cos_sin(batch.positions, config.head_dim, config.rope_theta)
        max_blocks = batch.page_table.shape[1] * cache.page_size // self.block_size
        if wise is not None and wise.max_blocks != max_blocks:
            raise ValueError(f"the page table covers {max_blocks} blocks but the WiseState holds {wise.max_blocks}")
        self.dense_modes = torch.full((batch.size,), DENSE, dtype=torch.int32, device=cache.device)
        self.unused_support = torch.zeros(batch.size, config.num_attention_heads, max_blocks,
                                          dtype=torch.bool, device=cache.device)
        self.role, self.modes = "dense", None

    def begin_loop(self, loop: int) -> None:
        if self.wise is not None:
            self.role = self.wise.config.depth_role(loop)
            self.modes = self.wise.begin_loop(loop, self.batch)

    def attend(self, q, k, v, loop: int, layer: int) -> torch.Tensor:
        plane = loop * self.num_layers + layer
        self.cache.write(plane, self.batch.slot_mapping, k, v)
        if self.role == "dense":
            modes, support = self.dense_modes, self.unused_support
        else:
            modes, support = self.modes[layer], self.wise.gather(layer, self.batch)
        out, support = self.attention(q, self.cache.k[plane], self.cache.v[plane], self.batch.page_table,
                                      self.batch.seq_lens, modes, support, block_size=self.block_size,
                                      eta=self.eta)
        if self.role == "discover":
            self.wise.store(layer, self.batch, support)
        return out


# -- the model ------------------------------------------------------------------------------------
class OuroForCausalLM(nn.Module):
    """Ouro decoder with its LM head. `config` (ModelConfig), `tokenizer` (or None)."""

    def __init__(self, config: ModelConfig, tokenizer=None):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.model = OuroModel(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [..., hidden] (normed output of a loop) -> [..., vocab]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight)

    def run_loop(self, h: torch.Tensor, loop: int, ctx) -> torch.Tensor:
        """One pass over the shared layers, then `model.norm`. h: [..., hidden]."""
        ctx.begin_loop(loop)
        for layer in self.model.layers:
            h = layer(h, ctx, loop)
        return self.model.norm(h)

    @staticmethod
    def _check_ids(input_ids: torch.Tensor, dims: int) -> None:
        if input_ids.dim() != dims or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor with {dims} dims, "
                             f"got {input_ids.dtype}{list(input_ids.shape)}")

    def _sequence_context(self, seq: int, device, **cache_args) -> SequenceContext:
        if seq > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {seq} tokens exceeds max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        positions = torch.arange(seq, device=device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        return SequenceContext(cos, sin, self.config.num_hidden_layers, **cache_args)

    def forward(self, input_ids: torch.Tensor, *, return_exit_probs: bool = False):
        """input_ids: int64[batch, seq] -> logits [batch, seq, vocab] of the last loop; with
        return_exit_probs also the per-loop exit probabilities float32[batch, seq, loops]."""
        self._check_ids(input_ids, 2)
        ctx = self._sequence_context(input_ids.shape[1], input_ids.device)
        h = self.model.embed_tokens(input_ids)
        gates = []
        for loop in range(self.config.num_loops):
            h = self.run_loop(h, loop, ctx)
            if return_exit_probs:
                gates.append(self.model.early_exit_gate(h))
        logits = self.logits(h)
        return (logits, exit_probabilities(gates)) if return_exit_probs else logits

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: PagedKVCache,
                page_table: torch.Tensor) -> torch.Tensor:
        """Dense causal pass over right-padded prompts, storing K/V of every plane.

        input_ids: int64[batch, seq]; lengths: int64[batch] (real tokens per row, >= 1);
        page_table: int32[batch, max_pages] with pages reserved for `lengths` tokens.
        Returns the logits [batch, vocab] at each row's last real token.
        """
        self._check_ids(input_ids, 2)
        batch, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device)
        real = positions[None, :] < lengths[:, None]
        token_index = real.flatten().nonzero()[:, 0]
        slots = cache.slots(page_table, positions.expand(batch, seq))
        ctx = self._sequence_context(seq, input_ids.device, cache=cache, token_index=token_index,
                                     slots=slots.flatten()[token_index])
        h = self.model.embed_tokens(input_ids)
        for loop in range(self.config.num_loops):
            h = self.run_loop(h, loop, ctx)
        return self.logits(h[torch.arange(batch, device=h.device), lengths - 1])

    def decode_context(self, batch: DecodeBatch, cache: PagedKVCache, *, wise: WiseState | None = None,
                       kernel: str | Callable = "auto") -> DecodeContext:
        return DecodeContext(self.config, batch, cache, wise, kernel)

    def decode_step(self, tokens: torch.Tensor, batch: DecodeBatch, cache: PagedKVCache, *,
                    wise: WiseState | None = None, kernel: str | Callable = "auto") -> torch.Tensor:
        """tokens: int64[batch], the token at each row's position -> logits [batch, vocab].
        With `wise`, loops follow its WiseConfig roles; without, every loop is DENSE. kernel: a
        name ("auto", "reference", "triton") or a `prepare_decode_attention` callable."""
        self._check_ids(tokens, 1)
        ctx = self.decode_context(batch, cache, wise=wise, kernel=kernel)
        h = self.model.embed_tokens(tokens)
        for loop in range(self.config.num_loops):
            h = self.run_loop(h, loop, ctx)
        return self.logits(h)


# -- loading and export -------------------------------------------------------------------------
def from_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], *, tokenizer=None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> OuroForCausalLM:
    """An eval-mode model from HF-named numpy tensors (validated against `config`); see wise_torch.loading."""
    from wise_torch import loading
    return loading.from_tensors(config, tensors, tokenizer=tokenizer, dtype=dtype, device=device)


def load_model(path_or_name: str | Path, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> OuroForCausalLM:
    """A checkpoint directory or built-in model name as an eval-mode model; see wise_torch.loading."""
    from wise_torch import loading
    return loading.load_model(path_or_name, dtype=dtype, device=device)


def to_checkpoint_tensors(model: OuroForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights as float32 numpy arrays under the HF checkpoint names."""
    return {name: t.detach().to("cpu", torch.float32).numpy() for name, t in model.state_dict().items()}
