"""wise_torch.model: the Ouro forward against a numpy transcription, loading/export, and the
paged decode path against the full-sequence forward."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

import wise_torch as wt
from wise_core import rounding
from wise_torch.model import SequenceContext, fused_groups
from wise_core.checkpoint import Checkpoint, CheckpointError, load_checkpoint, random_tensors, save_checkpoint
from wise_core.presets import PRESETS


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
        ctx = SequenceContext(model.config, 2, 5, torch.float32, "cpu")
        gates = []
        model.run_tokens(ids.flatten(), ctx, gates)
        lams = [torch.sigmoid(g[:, 0]).view(2, 5) for g in gates]
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


def test_sharded_checkpoint_with_fused_parts_in_different_shards(tmp_path):
    """load_model reads each q/k/v and gate/up part through its own mapping: parts in different
    shards fuse into the weights from_tensors makes, bitwise."""
    config = PRESETS["test-tiny-gqa"]
    tensors = random_tensors(config, seed=3)
    save_checkpoint(tmp_path, Checkpoint(config, tensors, None), max_shard_bytes=20_000)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    split = [g for g in fused_groups(weight_map).values() if len({weight_map[name] for name in g}) > 1]
    assert split, "no fused weight has its parts in two shards: the case is not exercised"
    loaded, built = wt.load_model(tmp_path), wt.from_tensors(config, tensors)
    assert loaded.state_dict().keys() == built.state_dict().keys()
    for name, value in built.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


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
    vocab = model.config.vocab_size                                      # the messages of wise_jax.forward
    with pytest.raises(ValueError, match=rf"ids \[{vocab}\] outside the vocabulary \(size {vocab}\)"):
        model(torch.tensor([[1, vocab]]))
    with pytest.raises(ValueError, match=r"ids \[-1\] outside the vocabulary"):
        model(torch.tensor([[-1, 2]]))


def test_fused_projections_are_the_checkpoint_tensors_side_by_side():
    config = PRESETS["test-tiny-gqa"]
    tensors = random_tensors(config, seed=0, std=0.08)
    model = wt.from_tensors(config, tensors)
    layer = model.model.layers[1]
    w = lambda name: torch.from_numpy(tensors[f"model.layers.1.{name}"])  # noqa: E731
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([w("self_attn.q_proj.weight"),
                                                                  w("self_attn.k_proj.weight"),
                                                                  w("self_attn.v_proj.weight")]))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))


def test_bf16_logits_are_float32_and_unrounded():
    model = wt.load_model("random-tiny", dtype=torch.bfloat16)
    h = torch.randn(4, model.config.hidden_size).to(torch.bfloat16)
    logits = model.logits(h)
    exact = h.double() @ model.head_weight.double().T
    assert logits.dtype == torch.float32
    # fp32 accumulation of exact bf16 products: error <= hidden * 2^-24 * sum|products| (far below
    # bf16's 2^-8 relative rounding, which the old bf16 logits carried)
    bound = model.config.hidden_size * 2.0 ** -24 * (h.double().abs() @ model.head_weight.double().abs().T)
    assert bool(((logits.double() - exact).abs() <= bound).all())
    assert not torch.equal(logits, logits.to(torch.bfloat16).float())


def forced_logits(model, prompts, page_size, max_num_batched_tokens=8192, shuffle_seed=None):
    """Logits at every position of each prompt: a one-token context, then the rest forced
    through the engine's decode steps (pages taken from a shuffled free list)."""
    lens = [len(p) for p in prompts]
    llm = wt.LLM(model, num_pages=sum(-(-n // page_size) for n in lens) + 2, page_size=page_size,
                 max_num_seqs=len(prompts), max_model_len=max(lens) + 1, attention_backend="reference",
                 max_num_batched_tokens=max_num_batched_tokens)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(llm.blocks.free)
    ids = [llm.add_request(p[:1], wt.SamplingParams(max_tokens=len(p)), forced=p[1:] + [0], keep_logits=True)
           for p in prompts]
    seqs = [llm.sequences[i] for i in ids]
    llm.run_until_done(ids)
    return [torch.stack(s.logits) for s in seqs], [s for s in seqs]


@pytest.mark.parametrize("name, page_sizes", [("test-tiny", (32, 64, 128)), ("test-tiny-gqa", (32,))])
def test_paged_decode_matches_full_sequence_forward(name, page_sizes):
    model = make_model(name)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (1, 37, 70)]
    with torch.inference_mode():
        full = [model(torch.tensor(p)[None])[0] for p in prompts]
        runs = [forced_logits(model, prompts, ps, shuffle_seed=ps)[0] for ps in page_sizes]
    for decoded in runs:
        for got, want in zip(decoded, full):
            diff, bound = rounding.model_difference(got, want, model.config, keys=70)  # fp32: SDPA vs paged softmax
            assert diff <= bound, (diff, bound)
    for decoded in runs[1:]:  # the page layout does not change a bit of the result
        assert all(torch.equal(a, b) for a, b in zip(decoded, runs[0]))


def test_chunked_prefill_matches_full_sequence_forward():
    model = make_model("test-tiny-gqa")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (5, 40, 33, 90)]
    with torch.inference_mode():
        for budget in (7, 32, 8192):  # chunks of at most `budget` prompt tokens per step
            llm = wt.LLM(model, num_pages=16, page_size=32, max_num_seqs=4, max_model_len=128,
                         attention_backend="reference", max_num_batched_tokens=budget)
            random.Random(budget).shuffle(llm.blocks.free)
            ids = [llm.add_request(p, wt.SamplingParams(max_tokens=2), forced=[7, 8], keep_logits=True)
                   for p in prompts]
            seqs = [llm.sequences[i] for i in ids]
            llm.run_until_done(ids)
            for p, seq in zip(prompts, seqs):
                want = model(torch.tensor(p + [7])[None])[0, -2:]
                diff, bound = rounding.model_difference(torch.stack(seq.logits), want, model.config,
                                                        keys=len(p) + 1)  # fp32: SDPA vs chunked SDPA
                assert diff <= bound, (diff, bound)


def test_the_rope_table_grows_to_what_a_call_needs(monkeypatch):
    """A model starts with ROPE_ROWS rows of RoPE; a longer forward grows the table, to logits
    bitwise those of a model built with the whole table (a row does not depend on the length)."""
    from wise_torch import model as model_module

    config, tensors = PRESETS["test-tiny"], random_tensors(PRESETS["test-tiny"], seed=2, std=0.08)
    ids = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    whole = wt.from_tensors(config, tensors)
    whole.build_rope_table(config.max_position_embeddings)
    monkeypatch.setattr(model_module, "ROPE_ROWS", 16)
    short = wt.from_tensors(config, tensors)
    assert short.cos_sin.shape[0] == 16
    with torch.inference_mode():
        logits = short(ids)
        assert short.cos_sin.shape[0] == 40
        assert torch.equal(logits, whole(ids))
    with pytest.raises(ValueError, match="exceed max_position_embeddings"):
        short.rope_rows(config.max_position_embeddings + 1)
