"""Next-token choice on the device: greedy, or sampling in log space with top-p."""

from __future__ import annotations

import numpy as np
import torch

from wise_torch.attention import select_blocks

_GOLDEN = 0x9E3779B97F4A7C15


def seed_for(seed: int, position: int) -> int:
    """The generator seed of a seeded request's sample at `position` (independent of the batch)."""
    return (seed + (position + 1) * _GOLDEN) % (2 ** 63)


def sample(logits: torch.Tensor, temperatures: list[float], filters: list, generators: list[torch.Generator | None]
           ) -> torch.Tensor:
    """logits: float32[batch, vocab] -> int64[batch] on the logits' device. filters: per row
    anything with top_p, top_k and min_p (its SamplingParams).

    temperature 0 (or one that is 0 in float32, as in wise_jax): argmax (ties to the lower id).
    Otherwise Gumbel-max over (logits - max) / temperature: the scaled logits are <= 0, so no
    temperature overflows them (a tiny temperature is greedy, a huge one near-uniform),
    restricted by `scaled_logits`. Row i draws its noise from generators[i]. NaN logits stay NaN
    (argmax then points at one).
    """
    tokens = logits.argmax(-1)
    rows = [i for i, t in enumerate(temperatures) if np.float32(t) > 0]   # 0 in float32 (1e-50): greedy
    if not rows:
        return tokens
    index = torch.tensor(rows, device=logits.device)
    temperature = torch.tensor([temperatures[i] for i in rows], dtype=torch.float32, device=logits.device)
    z = scaled_logits(logits[index], temperature, [filters[i] for i in rows])
    u = torch.stack([torch.rand(z.shape[1], generator=generators[i], device=logits.device) for i in rows])
    tokens[index] = (z - torch.log(-torch.log(u))).argmax(-1)
    return tokens


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor, filters: list) -> torch.Tensor:
    """logits float32[rows, vocab], temperature float32[rows] (> 0), filters (top_p, top_k, min_p
    per row) -> (logits - max) / temperature, -inf outside each row's kept tokens: those of
    probability >= min_p x the largest, then the top_k most probable (ties to the lower id), then
    the top_p prefix of what is left (`SamplingParams`). The distribution `sample` draws from is
    their softmax."""
    z = (logits - logits.max(-1, keepdim=True).values) / temperature[:, None]
    for j, f in enumerate(filters):
        if f.min_p > 0:
            p = torch.softmax(z[j], -1)
            z[j] = torch.where(p >= f.min_p * p.max(), z[j], float("-inf"))
        if 0 < f.top_k < z.shape[1]:
            order = torch.sort(z[j], descending=True, stable=True).indices
            kept = torch.zeros_like(z[j], dtype=torch.bool).scatter_(0, order[:f.top_k], True)
            z[j] = torch.where(kept, z[j], float("-inf"))
        if f.top_p < 1.0:
            kept = select_blocks(torch.softmax(z[j], -1), f.top_p)
            z[j] = torch.where(kept, z[j], float("-inf"))
    return z
