"""Tensor parallelism of the Ouro decoder over the ranks of a `torch.distributed` process group.

Rank r of N holds query heads [r H/N, (r+1) H/N), KV heads [r KV/N, (r+1) KV/N) and MLP columns
[r I/N, (r+1) I/N) (H heads, KV heads, I = intermediate_size):
- qkv_proj, column-parallel: each of its q, k and v parts split by heads, the rank's rows
  q_r | k_r | v_r (the fused layout, at the local head counts);
- gate_up_proj, column-parallel: gate_r | up_r;
- o_proj and down_proj, row-parallel: the input columns of the rank's heads (MLP columns); each
  rank's output is a partial sum, added over the ranks by one all-reduce per projection;
- embeddings, norms, the early-exit gate and the LM head are replicated.
Query head h reads KV head h // (H / KV), so a rank's query heads read exactly its KV heads.

A rank's model is an `OuroForCausalLM` of `local_config` (heads, KV heads and intermediate size
divided by N) whose `tp` is this module's `TensorParallel`: everything kept per head -- the
paged K/V, the WISE supports, the decode kernels -- runs unchanged on the local heads.

The all-reduce adds the ranks' partial sums, each rounded to the model's dtype, so the hidden
states are those of a single device up to one more rounding per sublayer (not bitwise).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from wise_core.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group: rank (0 holds the scheduler) of size,
    over torch.distributed's default process group."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (every rank gets the same values); returns x."""
        dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's x on every rank, in place; returns x."""
        dist.broadcast(x, src)
        return x


def check_divisible(config: ModelConfig, size: int) -> None:
    """A named ValueError unless `size` ranks split the model's KV heads and MLP columns evenly
    (query heads then split too: they are a multiple of the KV heads)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    for name in ("num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name} "
                             f"({getattr(config, name)})")


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's shard: heads, KV heads and intermediate size divided by `size`."""
    check_divisible(config, size)
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // size,
                               num_key_value_heads=config.num_key_value_heads // size,
                               intermediate_size=config.intermediate_size // size)


def shard_tensor(name: str, t: torch.Tensor, config: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of the full model's state-dict tensor `name` (a new tensor where it is
    split; the tensor itself where it is replicated)."""
    leaf = name.partition(".layers.")[2].partition(".")[2] if name.startswith("model.layers.") else ""
    d = config.head_dim
    if leaf == "self_attn.qkv_proj.weight":
        parts = t.split([config.num_attention_heads * d, config.num_key_value_heads * d,
                         config.num_key_value_heads * d])
        return torch.cat([p.chunk(size)[rank] for p in parts])
    if leaf == "mlp.gate_up_proj.weight":
        return torch.cat([p.chunk(size)[rank] for p in t.chunk(2)])
    if leaf in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        return t.chunk(size, dim=1)[rank].contiguous()
    return t


def broadcast_shard(model, config: ModelConfig, tp: TensorParallel, *, dtype: torch.dtype,
                    device: torch.device, tokenizer=None):
    """This rank's shard of rank 0's whole model: every tensor of its state dict is broadcast
    from rank 0 in state-dict order and cut to this rank's part (`shard_tensor`), so a rank holds
    one whole tensor at a time besides its shard. model: rank 0's OuroForCausalLM of `config`
    (None on the other ranks) -> an eval-mode OuroForCausalLM of `local_config` with `tp` set."""
    from wise_torch.model import OuroForCausalLM
    if (model is None) != (tp.rank != 0):
        raise ValueError("rank 0, and only rank 0, passes the whole model")
    with torch.device("meta"):
        layout = OuroForCausalLM(config).state_dict()
    source = None if model is None else model.state_dict()
    state = {}
    for name, meta in layout.items():
        t = torch.empty(meta.shape, dtype=dtype, device=device) if source is None else source[name]
        state[name] = shard_tensor(name, tp.broadcast(t), config, tp.rank, tp.size)
    with torch.device("meta"):
        shard = OuroForCausalLM(local_config(config, tp.size), tokenizer=tokenizer)
    shard.load_state_dict(state, strict=True, assign=True)
    shard.build_rope_table()
    shard.tp = tp
    return shard.requires_grad_(False).eval()
