"""wise_core.huginn_reference against a transcription of the released Huginn modeling code
(recpre/raven_modeling_minimal.py: RavenForCausalLM.forward with a HuginnDynamicCache, "full"
lookup; generate_with_adaptive_compute with the KL criterion and the "latest-m4" lookup), on
HF-layout checkpoints written from random weights: prefill and cached decode at a fixed depth,
adaptive depth; the initial state; errors."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import bias as attn_bias

from wise_core import rounding
from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.checkpoint import Checkpoint, load_checkpoint, random_tensors, save_checkpoint
from wise_core.huginn_reference import (HuginnCache, huginn_forward, huginn_weights, initial_state, num_planes,
                                        plane_index)
from wise_core.presets import PRESETS

TINY = PRESETS["test-tiny-huginn"]


class ReleasedHuginn:
    """The released forward, transcribed in torch from its structure: blocks indexed by the
    released block_idx (prelude 0.., core prelude + step * core + layer, coda -1, -2, ...), a
    dynamic cache of K/V per block_idx, the complex-like RoPE from a freqs_cis table built as
    released (float32 angles), scaled_dot_product_attention as released (is_causal for a fresh
    prefill, causal_lower_right for a chunk after cached keys, no mask for one token)."""

    def __init__(self, config, tensors, dtype):
        self.c, self.dtype = config, dtype
        self.t = {k: torch.tensor(np.asarray(v, np.float32)).to(dtype) for k, v in tensors.items()}
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        d = config.hidden_size // config.num_attention_heads
        inv_freqs = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        if dtype == torch.float64:  # the spec's float32 frequencies (released: float32 power, within an ulp)
            inv_freqs = (config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)).float()
        freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float32), inv_freqs)
        freqs = freqs.to(dtype)  # float32 angles, as released; their cos / sin in the run's dtype
        self.freqs_cis = torch.stack([torch.cos(freqs)[None, :, None, :], torch.sin(freqs)[None, :, None, :]], dim=4)

    def norm(self, x, name):
        x32 = x.float() if self.dtype == torch.float32 else x
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps)).type_as(x) * self.t[name]

    def attn(self, x, p, freqs_cis, block_idx):
        B, S, E = x.shape
        H = self.c.num_attention_heads
        hd = E // H
        q, k, v = F.linear(x, self.t[p + "attn.Wqkv.weight"]).split([E, H * hd, H * hd], dim=2)
        q, k, v = q.view(B, S, H, hd), k.view(B, S, H, hd), v.view(B, S, H, hd)
        q_bias, k_bias = self.t[p + "attn.qk_bias"].split(1, dim=0)
        q, k = q + q_bias, k + k_bias
        qk_r2 = torch.cat([q, k], dim=2).unflatten(dim=-1, sizes=(-1, 2))
        f = freqs_cis
        rotated = torch.stack([qk_r2[..., 0] * f[..., 0] - qk_r2[..., 1] * f[..., 1],
                               qk_r2[..., 1] * f[..., 0] + qk_r2[..., 0] * f[..., 1]], -1).flatten(3)
        q, k = torch.split(rotated, H, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = self.update(block_idx, k, v)
        if q.shape[2] < k.shape[2]:
            if q.shape[2] > 1:
                bias = attn_bias.causal_lower_right(q.shape[2], k.shape[2])
                y = F.scaled_dot_product_attention(q, k, v, bias)
            else:
                y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(y.transpose(1, 2).reshape(B, S, E), self.t[p + "attn.proj.weight"])

    def update(self, block_idx, k, v):
        """The "full" lookup: the block's keys and values so far, these appended."""
        if block_idx in self.cache:
            k = torch.cat([self.cache[block_idx][0], k], dim=2)
            v = torch.cat([self.cache[block_idx][1], v], dim=2)
        self.cache[block_idx] = (k, v)
        return k, v

    def block(self, x, p, freqs_cis, block_idx):
        x = self.norm(self.attn(self.norm(x, p + "norm_1.weight"), p, freqs_cis, block_idx) + x, p + "norm_2.weight")
        fc1, fc2 = F.linear(self.norm(x, p + "norm_3.weight"), self.t[p + "mlp.fc.weight"]).chunk(2, dim=-1)
        mlp = F.linear(F.silu(fc1) * fc2, self.t[p + "mlp.proj.weight"])
        return self.norm(mlp + x, p + "norm_4.weight")

    def forward(self, ids, start, num_steps, state):
        c = self.c
        freqs_cis = self.freqs_cis[:, start:start + len(ids)]
        x = F.embedding(torch.tensor(ids)[None], self.t["transformer.wte.weight"]) * math.sqrt(c.hidden_size)
        block_idx = -1
        for n in range(c.n_layers_in_prelude):
            block_idx += 1
            x = self.block(x, f"transformer.prelude.{n}.", freqs_cis, block_idx)
        embeds, x = x, torch.tensor(state)[None].to(self.dtype)
        for _ in range(num_steps):
            x = F.linear(torch.cat([x, embeds], dim=-1), self.t["transformer.adapter.weight"])
            for n in range(c.n_layers_in_recurrent_block):
                block_idx += 1
                x = self.block(x, f"transformer.core_block.{n}.", freqs_cis, block_idx)
        x = self.norm(x, "transformer.ln_f.weight")
        block_idx = 0
        for n in range(c.n_layers_in_coda):
            block_idx -= 1
            x = self.block(x, f"transformer.coda.{n}.", freqs_cis, block_idx)
        x = self.norm(x, "transformer.ln_f.weight")
        return F.linear(x, self.t["transformer.wte.weight"])[0].double().numpy()  # the tied head


def checkpoint(tmp_path, config=TINY, seed=0):
    """An HF-layout checkpoint of random weights (norm weights off 1, q / k biases non-zero, std
    0.08 so that attention is not flat), written and read back."""
    tensors = random_tensors(config, seed=seed, std=0.08)
    rng = np.random.default_rng(seed + 1)
    tensors = {k: v + np.float32(0.1) * rng.normal(size=v.shape).astype(np.float32) if "norm" in k else v
               for k, v in tensors.items()}
    save_checkpoint(tmp_path / "ckpt", Checkpoint(config, tensors))
    return load_checkpoint(tmp_path / "ckpt")


def depth(config, num_steps):
    return config.n_layers_in_prelude + config.n_layers_in_recurrent_block * num_steps + config.n_layers_in_coda


def bound(config, num_steps, want, keys, dtype):
    """`rounding.network_bound` over the model's depth (prelude + core * steps + coda sublayers),
    width its longest reduction (the adapter's 2 hidden, the MLP's, the keys); float64 runs scale
    float32's bound by their unit roundoffs' ratio."""
    width = max(2 * config.hidden_size, config.intermediate_size, keys)
    b = rounding.network_bound(scale=float(np.abs(want).max()), depth=depth(config, num_steps), width=width)
    return b * (rounding.unit_roundoff("float64") / rounding.unit_roundoff("float32") if dtype == torch.float64 else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prefill_and_decode_match_released_transcription(tmp_path, dtype):
    """Prefill of 11 tokens, then 3 cached decode steps and a 2-token chunk (16 positions), 5 core iterations:
    the reference's logits equal the transcription's within rounding at every call."""
    ckpt = checkpoint(tmp_path)
    config, weights = ckpt.config, huginn_weights(ckpt.config, ckpt.tensors)
    released = ReleasedHuginn(config, ckpt.tensors, dtype)
    ids = np.random.default_rng(4).integers(0, config.vocab_size, 16)
    cache, steps, start = HuginnCache(), 5, 0
    for chunk in (11, 1, 1, 1, 2):
        tokens = ids[start:start + chunk]
        state = initial_state(config, np.arange(start, start + chunk), seed=7)
        want = huginn_forward(config, weights, tokens, num_steps=steps, cache=cache, seed=7)
        got = released.forward(tokens, start, steps, state)
        diff = np.abs(got - want).max()
        assert diff <= bound(config, steps, want, start + chunk, dtype), (chunk, diff)
        start += chunk
    assert cache.length == 16 and len(cache.planes) == depth(config, steps)
    assert all(k.shape == (16, config.num_key_value_heads, config.head_dim) for k, _ in cache.planes.values())


def test_decode_equals_prefill(tmp_path):
    """The seeded state depends on (seed, position) only: prefill then token-by-token decode gives
    the one-call prefill's logits (float64, the same arithmetic but for the keys' split)."""
    ckpt = checkpoint(tmp_path)
    config, weights = ckpt.config, huginn_weights(ckpt.config, ckpt.tensors)
    ids = np.random.default_rng(5).integers(0, config.vocab_size, 9)
    full = huginn_forward(config, weights, ids, num_steps=3, seed=2)
    cache = HuginnCache()
    parts = [huginn_forward(config, weights, ids[:6], num_steps=3, cache=cache, seed=2)]
    parts += [huginn_forward(config, weights, ids[i:i + 1], num_steps=3, cache=cache, seed=2) for i in range(6, 9)]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-10 * np.abs(full).max())
    other_seed = huginn_forward(config, weights, ids, num_steps=3, seed=3)
    assert np.abs(other_seed - full).max() > 1e-3  # the state matters: a different seed, other logits


def test_initial_state():
    positions = np.arange(3, 40)
    s = initial_state(TINY, positions, seed=1)
    assert s.shape == (37, TINY.hidden_size)
    scale = TINY.state_std * TINY.embed_scale  # sqrt(2/5): std before truncation
    assert np.abs(s).max() <= 3 * scale and np.abs(s).max() > 2 * scale
    assert abs(s.std() / scale - 0.986) < 0.03  # a normal truncated at 3 sigma has std 0.9866
    np.testing.assert_array_equal(initial_state(TINY, positions[5:7], seed=1), s[5:7])  # per position
    assert not np.array_equal(initial_state(TINY, positions, seed=2), s)
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        initial_state(TINY, positions, seed=-1)
    zero = dataclasses.replace(TINY, state_init="zero")
    np.testing.assert_array_equal(initial_state(zero, positions, seed=1), 0.0)


def test_zero_state_matches_transcription(tmp_path):
    ckpt = checkpoint(tmp_path, dataclasses.replace(TINY, state_init="zero"))
    config = ckpt.config
    ids = np.random.default_rng(6).integers(0, config.vocab_size, 7)
    want = huginn_forward(config, huginn_weights(config, ckpt.tensors), ids, num_steps=2)
    got = ReleasedHuginn(config, ckpt.tensors, torch.float64).forward(ids, 0, 2, np.zeros((7, config.hidden_size)))
    assert np.abs(got - want).max() <= bound(config, 2, want, 7, torch.float64)


def test_errors(tmp_path):
    ckpt = checkpoint(tmp_path)
    config, weights = ckpt.config, huginn_weights(ckpt.config, ckpt.tensors)
    cache = HuginnCache()
    huginn_forward(config, weights, [1, 2, 3], num_steps=2, cache=cache)
    with pytest.raises(ValueError, match="core iteration 2 holds K/V for 0 of the 3 cached positions"):
        huginn_forward(config, weights, [4], num_steps=3, cache=cache)
    huginn_forward(config, weights, [4], num_steps=1, cache=cache)  # shallower: fine
    with pytest.raises(ValueError, match="core iteration 1 holds K/V for 3 of the 4 cached positions"):
        huginn_forward(config, weights, [5], num_steps=2, cache=cache)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 384\)"):
        huginn_forward(config, weights, [384])
    with pytest.raises(ValueError, match="num_steps must be a non-negative integer"):
        huginn_forward(config, weights, [1], num_steps=-1)
    with pytest.raises(ValueError, match=r"state must be \[1, 128\]"):
        huginn_forward(config, weights, [1], state=np.zeros((2, 128)))
    with pytest.raises(ValueError, match="needs a Huginn config"):
        huginn_weights(PRESETS["test-tiny"], ckpt.tensors)


def test_planes():
    """Prelude planes, then the coda's, then (iteration, core layer): huginn-0125 at 32 iterations has 132."""
    c = PRESETS["huginn-0125"]
    got = [plane_index(c, "prelude", 0), plane_index(c, "prelude", 1), plane_index(c, "coda", 0),
           plane_index(c, "coda", 1), plane_index(c, "core_block", 0, 0), plane_index(c, "core_block", 3, 31)]
    assert got == [0, 1, 2, 3, 4, 4 + 31 * 4 + 3] and num_planes(c, 32) == 132


class ReleasedAdaptive(ReleasedHuginn):
    """generate_with_adaptive_compute for one sequence, transcribed: criterion "kl"
    (KLExitEvaluator: KL(previous || current) of the last position's log-probabilities from the
    coda and head after each iteration from min_steps on, previous starting uniform), checks off
    in prefill (do_not_exit_in_prefill), and HuginnDynamicCache's per-position entries with the
    "latest-m4" lookup, its hard-coded 2 prelude and 4 core layers taken from the config."""

    def __init__(self, config, tensors, dtype):
        super().__init__(config, tensors, dtype)
        self.entries: dict[int, dict[int, tuple]] = {}
        self.seen = 0

    def update(self, block_idx, k, v):
        if block_idx == 0:
            self.seen += k.shape[2]
        held = self.entries.setdefault(block_idx, {})
        for i in range(k.shape[2]):
            held[self.seen - k.shape[2] + i] = (k[:, :, i], v[:, :, i])
        if len(held) == self.seen:
            keys = [held[pos] for pos in range(self.seen)]
        else:
            P, C = self.c.n_layers_in_prelude, self.c.n_layers_in_recurrent_block
            keys = []
            for pos in range(self.seen):
                if block_idx >= P:
                    valid = [s for s in range(block_idx + 1) if pos in self.entries.get(s, {})]
                    step = max(s for s in valid if s >= P and (s - P) % C == (block_idx - P) % C)
                else:
                    step = block_idx if pos in held else 0
                keys.append(self.entries[step][pos])
        return torch.stack([kv[0] for kv in keys], dim=2), torch.stack([kv[1] for kv in keys], dim=2)

    def decode(self, token, pos, max_steps, state, threshold, min_steps):
        """One token: (logits [vocab], iterations run)."""
        c = self.c
        freqs_cis = self.freqs_cis[:, pos:pos + 1]
        x = F.embedding(torch.tensor([[token]]), self.t["transformer.wte.weight"]) * math.sqrt(c.hidden_size)
        block_idx = -1
        for n in range(c.n_layers_in_prelude):
            block_idx += 1
            x = self.block(x, f"transformer.prelude.{n}.", freqs_cis, block_idx)
        embeds, x = x, torch.tensor(state)[None].to(self.dtype)
        previous = torch.full((c.vocab_size,), 1.0 / c.vocab_size, dtype=self.dtype).log()
        logits = None
        for step in range(max_steps):
            x = F.linear(torch.cat([x, embeds], dim=-1), self.t["transformer.adapter.weight"])
            for n in range(c.n_layers_in_recurrent_block):
                block_idx += 1
                x = self.block(x, f"transformer.core_block.{n}.", freqs_cis, block_idx)
            if step < min_steps:
                continue
            logits = self.head(x, freqs_cis)
            log_probs = F.log_softmax(logits, dim=-1)
            kl = F.kl_div(log_probs, previous, reduction="none", log_target=True).sum(dim=-1)
            previous = log_probs
            if kl < threshold:
                return logits.double().numpy(), step + 1
        return (self.head(x, freqs_cis) if logits is None else logits).double().numpy(), max_steps

    def head(self, x, freqs_cis):
        x = self.norm(x, "transformer.ln_f.weight")
        block_idx = 0
        for n in range(self.c.n_layers_in_coda):
            block_idx -= 1
            x = self.block(x, f"transformer.coda.{n}.", freqs_cis, block_idx)
        return F.linear(self.norm(x, "transformer.ln_f.weight"), self.t["transformer.wte.weight"])[0, -1]


def test_adaptive_depth_matches_released_transcription(tmp_path):
    """Greedy decode with per-token KL exits after an 8-token prompt (prefill at full depth), 6
    iterations at most, float64: the reference's tokens, exit depths and logits equal the
    transcription's with its "latest-m4" lookups, and tokens exit at different depths (so later
    tokens read positions whose later iterations were never computed)."""
    ckpt = checkpoint(tmp_path)
    config, weights = ckpt.config, huginn_weights(ckpt.config, ckpt.tensors)
    prompt = np.random.default_rng(8).integers(0, config.vocab_size, 8)
    steps, new = 6, 8
    adaptive = AdaptiveDepth(threshold=0.15, min_steps=1)   # among this model's KLs (0.09 to 0.44): exits vary
    released = ReleasedAdaptive(config, ckpt.tensors, torch.float64)
    logits = released.forward(prompt, 0, steps, initial_state(config, np.arange(8), seed=3))
    cache = HuginnCache()
    want = huginn_forward(config, weights, prompt, num_steps=steps, cache=cache, seed=3)
    assert np.abs(logits - want).max() <= bound(config, steps, want, 8, torch.float64)
    token, depths = int(want[-1].argmax()), []
    for pos in range(8, 8 + new):
        got, depth_run = released.decode(token, pos, steps, initial_state(config, [pos], seed=3),
                                         adaptive.threshold, adaptive.min_steps)
        want = huginn_forward(config, weights, [token], num_steps=steps, cache=cache, seed=3, adaptive=adaptive)[0]
        assert cache.depths[-1] == depth_run, pos
        assert np.abs(got - want).max() <= bound(config, steps, want, pos + 1, torch.float64), pos
        depths.append(depth_run)
        token = int(want.argmax())
        assert int(got.argmax()) == token
    assert len(set(depths)) > 1 and min(depths) < steps, depths
    assert cache.depths == [steps] * 8 + depths
    assert all(len(cache.planes[plane_index(config, "core_block", n, s)][0]) == 8 + new
               for n in range(config.n_layers_in_recurrent_block) for s in range(steps))


def test_adaptive_depth_settings():
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        AdaptiveDepth(threshold=float("nan"))
    with pytest.raises(ValueError, match="min_steps must be a non-negative int"):
        AdaptiveDepth(min_steps=-1)
    with pytest.raises(ValueError, match="adaptive depth decodes one token a call"):
        huginn_forward(TINY, {}, [1, 2], adaptive=AdaptiveDepth())
