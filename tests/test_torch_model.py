"""wise_torch.model: the Ouro forward against a numpy transcription, loading/export, and the
paged decode path against the full-sequence forward."""

import dataclasses
import random

import numpy as np
import pytest
import torch

import wise_torch as wt
from wise_core import rounding
from wise_core.checkpoint import CheckpointError, load_checkpoint, random_tensors
from wise_core.config import PRESETS


def make_model(name, **changes):
    config = dataclasses.replace(PRESETS[name], **changes)
    return wt.from_tensors(config, random_tensors(config, seed=0, std=0.08))


def numpy_ouro(config, t, ids):
    """float64 transcription of the Ouro forward (docs/DESIGN.md "Model")."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    d, heads, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps) * w

    def rope(x):  # x: [seq, heads, d]
        inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2) / d)
        ang = np.arange(x.shape[0])[:, None] * inv
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    h = t["model.embed_tokens.weight"][ids]
    seq = len(ids)
    mask = np.tril(np.ones((seq, seq), bool))
    for _ in range(config.total_ut_steps):
        for n in range(config.num_hidden_layers):
            w = lambda name: t[f"model.layers.{n}.{name}"]  # noqa: E731
            x = rms(h, w("input_layernorm.weight"))
            q = rope((x @ w("self_attn.q_proj.weight").T).reshape(seq, heads, d))
            k = rope((x @ w("self_attn.k_proj.weight").T).reshape(seq, kv, d))
            v = (x @ w("self_attn.v_proj.weight").T).reshape(seq, kv, d)
            k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
            s = np.where(mask[None], np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d), -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            a = np.einsum("hqk,khd->qhd", p, v).reshape(seq, heads * d)
            h = h + rms(a @ w("self_attn.o_proj.weight").T, w("input_layernorm_2.weight"))
            x = rms(h, w("post_attention_layernorm.weight"))
            g, u = x @ w("mlp.gate_proj.weight").T, x @ w("mlp.up_proj.weight").T
            m = (g / (1 + np.exp(-g)) * u) @ w("mlp.down_proj.weight").T
            h = h + rms(m, w("post_attention_layernorm_2.weight"))
        h = rms(h, t["model.norm.weight"])
    return h @ t["lm_head.weight"].T


@pytest.mark.parametrize("name", ["test-tiny", "test-tiny-gqa"])
def test_forward_matches_numpy_transcription(name):
    config = dataclasses.replace(PRESETS[name], num_hidden_layers=1, total_ut_steps=2)
    tensors = random_tensors(config, seed=3, std=0.08)
    tensors = {k: (v + np.float32(0.1) * np.random.default_rng(1).normal(size=v.shape).astype(np.float32)
                   if "norm" in k else v) for k, v in tensors.items()}  # non-trivial norm weights
    model = wt.from_tensors(config, tensors)
    ids = np.random.default_rng(2).integers(0, config.vocab_size, 9)
    with torch.inference_mode():
        got = model(torch.tensor(ids)[None])[0].double().numpy()
    expected = numpy_ouro(config, tensors, ids)
    diff, bound = rounding.model_difference(got, expected, config, keys=9)  # fp32 model vs fp64 spec
    assert diff <= bound, (diff, bound)


def test_exit_probabilities():
    model = make_model("test-tiny")
    ids = torch.randint(0, 384, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits, exits = model(ids, return_exit_probs=True)
        assert torch.equal(logits, model(ids))
        assert exits.shape == (2, 5, 4) and exits.dtype == torch.float32
        # p sums to 1 exactly; float32 products and a sum of 4 terms
        assert (exits.sum(-1) - 1).abs().max().item() <= rounding.gamma(3 * 4)
        # Rebuild lambda from the gate on each loop's hidden state and check p_t by hand.
        h = model.model.embed_tokens(ids)
        ctx = model._sequence_context(5, "cpu")
        lams = []
        for loop in range(4):
            h = model.run_loop(h, loop, ctx)
            lams.append(torch.sigmoid(model.model.early_exit_gate(h)[..., 0]))
    remaining = torch.ones(2, 5)
    for t in range(3):  # the same products in another order: a few roundings of values <= 1
        assert (exits[..., t] - lams[t] * remaining).abs().max().item() <= rounding.gamma(3 * 4)
        remaining = remaining * (1 - lams[t])
    assert (exits[..., 3] - remaining).abs().max().item() <= rounding.gamma(3 * 4)


def test_load_model_and_export_round_trip():
    model = wt.load_model("random-tiny")
    assert model.tokenizer is not None and model.config == load_checkpoint("random-tiny").config
    exported = wt.to_checkpoint_tensors(model)
    original = load_checkpoint("random-tiny").tensors
    assert sorted(exported) == sorted(original)
    for name in original:
        assert np.array_equal(exported[name], original[name]), name
    half = wt.load_model("random-tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_tied_embeddings_use_the_embedding_as_head():
    config = dataclasses.replace(PRESETS["test-tiny"], tie_word_embeddings=True)
    tensors = random_tensors(config, seed=0, std=0.08)
    model = wt.from_tensors(config, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]})
    assert model.lm_head is None and "lm_head.weight" not in wt.to_checkpoint_tensors(model)
    h = torch.randn(3, config.hidden_size)
    assert torch.equal(model.logits(h), h @ model.model.embed_tokens.weight.T)


def test_load_errors():
    with pytest.raises(CheckpointError, match="unknown model 'nope'"):
        wt.load_model("nope")
    with pytest.raises(ValueError, match="dtype must be a floating dtype of"):
        wt.load_model("random-tiny", dtype=torch.int32)
    config = PRESETS["test-tiny"]
    tensors = random_tensors(config)
    del tensors["model.norm.weight"]
    with pytest.raises(CheckpointError, match="missing tensor 'model.norm.weight'"):
        wt.from_tensors(config, tensors)
    model = make_model("test-tiny")
    with pytest.raises(ValueError, match="integer tensor with 2 dims"):
        model(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        model(torch.zeros(1, 1025, dtype=torch.int64))


def decode_every_position(model, prompts, page_size, seed):
    """Logits at every position of each prompt, decoded one token per step from an empty cache
    (pages taken from a shuffled free list, rows leaving the batch as they end)."""
    lens = [len(p) for p in prompts]
    cache = wt.PagedKVCache.for_model(model.config, num_pages=sum(-(-n // page_size) for n in lens) + 2,
                                      page_size=page_size)
    random.Random(seed).shuffle(cache.free_pages)
    max_pages = -(-max(lens) // page_size)
    out = [[] for _ in prompts]
    for t in range(max(lens)):
        rows = [i for i, n in enumerate(lens) if n > t]
        for i in rows:
            cache.reserve(i, t + 1)
        batch = cache.decode_batch(rows, [t + 1] * len(rows), max_pages)
        logits = model.decode_step(torch.stack([prompts[i][t] for i in rows]), batch, cache, kernel="reference")
        for r, i in enumerate(rows):
            out[i].append(logits[r])
    pages_used = [cache.pages[i] for i in range(len(prompts))]
    return [torch.stack(o) for o in out], pages_used


@pytest.mark.parametrize("name, page_sizes", [("test-tiny", (32, 64, 128)), ("test-tiny-gqa", (32,))])
def test_paged_decode_matches_full_sequence_forward(name, page_sizes):
    model = make_model(name)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (1, 37, 70)]
    with torch.inference_mode():
        full = [model(p[None])[0] for p in prompts]
        runs = [decode_every_position(model, prompts, ps, seed=ps) for ps in page_sizes]
    for decoded, pages in runs:
        flat = [page for row in pages for page in row]
        assert flat != sorted(flat)  # pages came out of order
        for got, want in zip(decoded, full):
            diff, bound = rounding.model_difference(got, want, model.config, keys=70)  # fp32: SDPA vs paged softmax
            assert diff <= bound, (diff, bound)
    for decoded, _ in runs[1:]:  # the page layout does not change a bit of the result
        assert all(torch.equal(a, b) for a, b in zip(decoded, runs[0][0]))


def test_prefill_writes_cache_and_returns_last_logits():
    model = make_model("test-tiny-gqa")
    g = torch.Generator().manual_seed(1)
    lens = [5, 40, 33]
    ids = torch.randint(0, 384, (3, 40), generator=g)
    cache = wt.PagedKVCache.for_model(model.config, num_pages=8, page_size=32)
    random.Random(0).shuffle(cache.free_pages)
    for i, n in enumerate(lens):
        cache.reserve(i, n + 1)
    table = cache.page_table([0, 1, 2], 2)
    with torch.inference_mode():
        last = model.prefill(ids, torch.tensor(lens), cache, table)
        for i, n in enumerate(lens):
            diff, bound = rounding.model_difference(last[i], model(ids[i:i + 1, :n])[0, -1], model.config, keys=40)
            assert diff <= bound, (diff, bound)
        # The next token decoded against the prefilled cache continues the sequence.
        batch = cache.decode_batch([0, 1, 2], [n + 1 for n in lens], 2)
        nxt = torch.tensor([7, 8, 9])
        step = model.decode_step(nxt, batch, cache, kernel="reference")
        for i, n in enumerate(lens):
            seq = torch.cat([ids[i, :n], nxt[i:i + 1]])[None]
            diff, bound = rounding.model_difference(step[i], model(seq)[0, -1], model.config, keys=41)
            assert diff <= bound, (diff, bound)
