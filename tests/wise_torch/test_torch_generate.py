"""wise_torch.generate / teacher_force: batching, WISE equivalences, stopping, sampling, errors."""

import os

import numpy as np
import pytest
import torch

import wise_torch as wt
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.config_error import ConfigError
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from cases import prompts_of


@pytest.fixture(scope="module", params=["test-tiny", "test-tiny-gqa"])
def model(request):
    config = PRESETS[request.param]
    return wt.from_tensors(config, random_tensors(config, seed=0, std=0.08))


@pytest.fixture(scope="module")
def byte_model():
    return wt.load_model("random-tiny")


def test_batch_gives_each_prompt_its_tokens_alone(model):
    prompts = prompts_of([3, 40, 17], model.config.vocab_size)
    both = wt.generate(model, prompts, max_new_tokens=12, eos_token_id=None, page_size=32, return_logits=True)
    for i, prompt in enumerate(prompts):
        alone = wt.generate(model, [prompt], max_new_tokens=12, eos_token_id=None, page_size=32,
                            return_logits=True)
        assert both.tokens[i] == alone.tokens[0]
        diff, bound = rounding.model_difference(both.logits[i], alone.logits[0], model.config, keys=52)  # batch shapes
        assert diff <= bound, (diff, bound)
    assert [len(t) for t in both.tokens] == [12, 12, 12]
    assert both.logits[1].shape == (12, model.config.vocab_size) and both.logits[1].dtype == torch.float32
    assert both.texts is None and both.stats.fallbacks is None and both.stats.density is None
    assert both.stats.prefill_tokens == 60 and both.stats.new_tokens == 36
    assert both.stats.decode_tokens_per_s == (36 - 3) / both.stats.decode_s  # decode steps only


def test_all_blocks_wise_is_bitwise_dense(model):
    prompts = prompts_of([70, 5, 33], model.config.vocab_size, seed=1)
    dense = wt.generate(model, prompts, max_new_tokens=8, eos_token_id=None, page_size=32, return_logits=True)
    wise = wt.generate(model, prompts, max_new_tokens=8, eos_token_id=None, page_size=32, return_logits=True,
                       wise_config=WiseConfig(all_blocks=True))
    assert wise.tokens == dense.tokens
    assert all(torch.equal(a, b) for a, b in zip(wise.logits, dense.logits))
    assert wise.stats.density == {2: 1.0, 3: 1.0} and wise.stats.fallbacks == 0


def test_discovery_alone_is_bitwise_dense_and_real_wise_is_sparse(model):
    prompts = prompts_of([100, 66], model.config.vocab_size, seed=2)
    args = dict(max_new_tokens=6, eos_token_id=None, page_size=64, return_logits=True)
    dense = wt.generate(model, prompts, **args)
    discover_only = wt.generate(model, prompts, wise_config=WiseConfig(reuse_depths=()), **args)
    assert all(torch.equal(a, b) for a, b in zip(discover_only.logits, dense.logits))
    assert discover_only.stats.density == {} and discover_only.stats.fallbacks == 0
    wise = wt.generate(model, prompts, wise_config=WiseConfig(eta=0.5), **args)
    assert wise.stats.fallbacks == 0
    assert all(0 < d < 1 for d in wise.stats.density.values())
    assert not all(torch.equal(a, b) for a, b in zip(wise.logits, dense.logits))


def test_teacher_force_scores_what_generate_produced(model):
    prompt = prompts_of([45], model.config.vocab_size, seed=3)[0]
    scored = {}
    for wise_config in (None, WiseConfig(eta=0.8)):
        gen = wt.generate(model, [prompt], max_new_tokens=7, eos_token_id=None, return_logits=True,
                          wise_config=wise_config)
        forced = wt.teacher_force(model, prompt, gen.tokens[0], wise_config=wise_config)
        want = torch.log_softmax(gen.logits[0], -1).gather(1, torch.tensor(gen.tokens[0])[:, None])[:, 0]
        assert torch.equal(forced.logprobs[0], want)  # the same decode step, the same batch
        assert forced.stats.new_tokens == 7 and forced.stats.fallbacks == gen.stats.fallbacks
        scored[wise_config is None] = forced.logprobs[0], gen.tokens[0]
    logprobs, tokens = scored[True]
    batch = wt.teacher_force(model, [prompt, prompt[:9]], [tokens, tokens[:2]])
    short = wt.teacher_force(model, prompt[:9], tokens[:2])
    assert [len(x) for x in batch.logprobs] == [7, 2]
    for got, want in ((batch.logprobs[0], logprobs), (batch.logprobs[1], short.logprobs[0])):  # batch shapes differ
        diff, bound = rounding.model_difference(got, want, model.config, keys=len(prompt) + 7)
        assert diff <= bound, (diff, bound)
    as_arrays = wt.teacher_force(model, np.array(prompt[:9]), torch.tensor(tokens[:2]))
    assert torch.equal(as_arrays.logprobs[0], short.logprobs[0])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton in its CPU interpreter")
def test_triton_kernel_through_generate():
    config = PRESETS["test-tiny-gqa"]
    model = wt.from_tensors(config, random_tensors(config, seed=0, std=0.08))
    prompts = prompts_of([70, 5], config.vocab_size, seed=5)

    def run(kernel, **wise):
        return wt.generate(model, prompts, max_new_tokens=2, eos_token_id=None, page_size=32, return_logits=True,
                           attention_backend=kernel, wise_config=WiseConfig(**wise) if wise else None)

    dense_ref, dense_tri = run("reference"), run("triton")
    assert dense_tri.tokens == dense_ref.tokens
    for a, b in zip(dense_tri.logits, dense_ref.logits):
        diff, bound = rounding.model_difference(a, b, config, keys=72)  # fp32, another summation order
        assert diff <= bound, (diff, bound)
    all_blocks = run("triton", all_blocks=True)
    assert all(torch.equal(a, b) for a, b in zip(all_blocks.logits, dense_tri.logits))
    sparse_ref, sparse_tri = run("reference", eta=0.5), run("triton", eta=0.5)
    assert sparse_tri.tokens == sparse_ref.tokens and sparse_tri.stats.density == sparse_ref.stats.density
    assert sparse_tri.stats.density[2] < 1.0


def test_eos_stops_each_row(byte_model):
    prompts = [[65, 66, 67], [10, 11]]
    free = wt.generate(byte_model, prompts, max_new_tokens=10, eos_token_id=None)
    assert [len(t) for t in free.tokens] == [10, 10]
    eos = free.tokens[0][3]
    stopped = wt.generate(byte_model, prompts, max_new_tokens=10, eos_token_id=eos)
    for row, tokens in enumerate(free.tokens):
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert stopped.tokens[row] == tokens[:cut]
    assert len(stopped.tokens[0]) <= 4


def test_string_prompts_and_default_eos(byte_model):
    out = wt.generate(byte_model, ["def fib(n):", "x"], max_new_tokens=5)
    ids = wt.generate(byte_model, [list(b"def fib(n):"), list(b"x")], max_new_tokens=5)
    assert out.tokens == ids.tokens and len(out.texts) == 2
    assert out.texts[0] == byte_model.tokenizer.decode(out.tokens[0])
    for tokens in out.tokens:  # the model's eos (256) ends a row
        assert 256 not in tokens[:-1]
    # One string context and continuation score the text, not its characters one by one.
    forced = wt.teacher_force(byte_model, "def fib(n):", "\n    return")
    by_ids = wt.teacher_force(byte_model, list(b"def fib(n):"), list(b"\n    return"))
    assert len(forced.logprobs) == 1 and torch.equal(forced.logprobs[0], by_ids.logprobs[0])


def test_sampling(model):
    prompts = prompts_of([20, 9], model.config.vocab_size, seed=4)
    args = dict(max_new_tokens=10, eos_token_id=None)
    a = wt.generate(model, prompts, temperature=1.0, seed=7, **args)
    b = wt.generate(model, prompts, temperature=1.0, seed=7, **args)
    assert a.tokens == b.tokens
    greedy = wt.generate(model, prompts, **args)
    nucleus_of_one = wt.generate(model, prompts, temperature=1.0, top_p=1e-6, seed=1, **args)
    assert nucleus_of_one.tokens == greedy.tokens
    hot = wt.generate(model, prompts, temperature=5.0, seed=3, **args)
    assert hot.tokens != greedy.tokens


def test_bad_inputs_are_named(byte_model, model):
    gen = wt.generate
    with pytest.raises(ValueError, match=r"prompts\[0\]: 4090 tokens \+ 7 more exceed max_position_embeddings \(4096\)"):
        gen(byte_model, [[1] * 4090], max_new_tokens=7)
    with pytest.raises(ValueError, match="non-empty list"):     # as wise_jax.generate's (wise_core.generation)
        gen(byte_model, [], max_new_tokens=1)
    with pytest.raises(TypeError, match="non-empty list"):
        gen(byte_model, "a string", max_new_tokens=1)
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a string or a sequence of integer token ids, got \[1.5\]"):
        gen(byte_model, [[1.5]], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        gen(byte_model, [[1], []], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"outside the vocabulary \(size 258\)"):
        gen(byte_model, [[1, 300]], max_new_tokens=1)
    with pytest.raises(ValueError, match="has no tokenizer"):
        gen(model, ["text"], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        gen(byte_model, [[1]], max_new_tokens=0)
    with pytest.raises(TypeError, match="temperature must be a number, got '0.5'"):
        gen(byte_model, [[1]], max_new_tokens=1, temperature="0.5")
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        gen(byte_model, [[1]], max_new_tokens=1, temperature=1.0, seed=2 ** 70)
    with pytest.raises(TypeError, match="eos_token_id must be an int token id or None, got 'x'"):
        gen(byte_model, [[1]], max_new_tokens=1, eos_token_id="x")
    with pytest.raises(TypeError, match=r"wise_config must be a WiseConfig or None, got dict .*WiseConfig\(\*\*settings\)"):
        gen(byte_model, [[1]], max_new_tokens=1, wise_config={"eta": 0.9})
    with pytest.raises(ValueError, match=r"prompts\[0\] holds a lone surrogate"):
        gen(byte_model, ["a\udc80b"], max_new_tokens=1)
    with pytest.raises(ValueError, match="top_p"):
        gen(byte_model, [[1]], max_new_tokens=1, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        gen(byte_model, [[1]], max_new_tokens=1, temperature=-1.0)
    with pytest.raises(ValueError, match="page_size must be a positive multiple of the block_size 32, got 48"):
        gen(byte_model, [[1]], max_new_tokens=1, wise_config=WiseConfig(), page_size=48)
    with pytest.raises(ConfigError, match="out of range"):
        gen(byte_model, [[1]], max_new_tokens=1, wise_config=WiseConfig(reuse_depths=(5,)))
    with pytest.raises(ValueError, match="'pallas' is not one of wise_torch's"):
        gen(byte_model, [[1]], max_new_tokens=2, wise_config=WiseConfig(), attention_backend="pallas")
    with pytest.raises(ValueError, match="2 contexts but 1 continuations"):
        wt.teacher_force(byte_model, [[1], [2]], [[3]])
    with pytest.raises(ValueError, match=r"continuation_ids\[0\] is empty"):
        wt.teacher_force(byte_model, [1, 2], [])
