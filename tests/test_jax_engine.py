"""wise_jax.LLM on the shared host side (wise_core.engine): requests joining between steps,
chunked prefill, preemption with offload, aborts and seeded sampling.

Every equality of tokens here is against `wise_jax.generate` run on the prompt alone (fp32,
reference kernel, CPU), whose pool holds the request whole and whose prompt prefills in one
chunk."""

import numpy as np
import pytest

import wise_jax
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.config import PRESETS, WiseConfig

CONFIG = PRESETS["test-tiny"]
PAGE = 32
WISE = WiseConfig(eta=0.5, kernel="reference")
MODES = pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])


@pytest.fixture(scope="module")
def params():
    return wise_jax.from_checkpoint_tensors(CONFIG, random_tensors(CONFIG, seed=5, std=0.08))


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]


def alone(params, prompt, n, wise_config, **kw):
    return wise_jax.generate(params, CONFIG, [prompt], max_new_tokens=n, eos_token_id=None, page_size=PAGE,
                             wise_config=wise_config, kernel="reference", **kw)


def engine(params, wise_config=None, **kw):
    kw = {"num_pages": 64, "page_size": PAGE, "max_num_seqs": 8, "max_model_len": 256, "kernel": "reference", **kw}
    return wise_jax.LLM(params, CONFIG, wise_config=wise_config, **kw)


@MODES
def test_a_prompt_longer_than_a_step_prefills_in_chunks_with_the_unchunked_tokens(params, wise_config):
    """150 prompt tokens at 40 a step: four chunks, three of them starting mid-page."""
    prompt = prompts_of([150])[0]
    llm = engine(params, wise_config, max_num_batched_tokens=40)
    rid = llm.add_request(prompt, wise_jax.SamplingParams(max_tokens=8, ignore_eos=True), keep_logits=True)
    seq, cached = llm.sequences[rid], []
    while not seq.prefilled:
        llm.step()
        cached.append(seq.num_cached)
    assert cached == [40, 80, 120, 150]
    out = llm.run_until_done([rid])[0]
    want = alone(params, prompt, 8, wise_config, return_logits=True)
    assert out.token_ids == want.tokens[0]
    # fp32; the chunks attend in a float32 softmax over gathered keys, the whole prompt through
    # prefill_attention: the same sums in another order over at most 150 keys
    diff, bound = rounding.model_difference(np.stack(seq.logits), want.logits[0], CONFIG, keys=160)
    assert diff <= bound, (diff, bound)
    stats = llm.stats()
    assert stats.prompt_tokens == 150 and stats.free_pages == stats.total_pages


@MODES
def test_requests_joining_between_steps_get_their_tokens_alone(params, wise_config):
    prompts = prompts_of([70, 3, 129, 40, 17], seed=1)
    news = [9, 14, 5, 11, 8]
    llm = engine(params, wise_config, max_num_batched_tokens=64)   # long prompts prefill in chunks
    ids, produced, step = {}, {}, 0
    while len(ids) < len(prompts) or llm.has_unfinished():
        if step % 3 == 0 and len(ids) < len(prompts):           # a new request every third step
            i = len(ids)
            ids[llm.add_request(prompts[i], wise_jax.SamplingParams(max_tokens=news[i], ignore_eos=True))] = i
        for out in llm.step():
            produced[ids[out.request_id]] = out
        step += 1
    for i, prompt in enumerate(prompts):
        assert produced[i].finished and produced[i].finish_reason == "length"
        assert produced[i].token_ids == alone(params, prompt, news[i], wise_config).tokens[0]
        assert produced[i].prompt_token_ids == prompt
    stats = llm.stats()
    assert stats.free_pages == stats.total_pages and stats.running == stats.waiting == 0
    assert stats.preemptions == 0
    if wise_config is not None:
        assert stats.fallbacks == 0 and all(0 < d < 1 for d in stats.density.values()), stats.density


@MODES
def test_preemption_offloads_and_resumes_with_the_same_tokens(params, wise_config):
    prompts = prompts_of([60, 50, 45, 33], seed=2)
    sampling = wise_jax.SamplingParams(max_tokens=40, ignore_eos=True)
    llm = engine(params, wise_config, num_pages=8)      # 8 pages of 32: the four cannot all grow
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    stats = llm.stats()
    assert stats.preemptions > 0
    assert stats.free_pages == stats.total_pages == 8
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == alone(params, prompt, 40, wise_config).tokens[0]
    if wise_config is not None:
        assert stats.fallbacks == 0


def test_seeded_sampling_survives_preemption_and_does_not_depend_on_the_batch(params):
    """A request's token i samples with its key folded with i: the same tokens in any batch, and
    when it is preempted and resumed."""
    prompts = prompts_of([60, 50, 45, 33], seed=3)
    sampling = [wise_jax.SamplingParams(max_tokens=40, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    tight = engine(params, num_pages=8)
    together = tight.generate(prompts, sampling, use_tqdm=False)
    assert tight.stats().preemptions > 0
    for prompt, params_, out in zip(prompts, sampling, together):
        assert out.token_ids == engine(params).generate([prompt], params_, use_tqdm=False)[0].token_ids
    other = engine(params).generate([prompts[0]], sampling[1], use_tqdm=False)[0]
    assert other.token_ids != together[0].token_ids


def test_abort_frees_pages_and_leaves_the_others_unchanged(params):
    prompts = prompts_of([40, 30, 20], seed=4)
    llm = engine(params)
    sampling = wise_jax.SamplingParams(max_tokens=12, ignore_eos=True)
    ids = [llm.add_request(p, sampling) for p in prompts]
    for _ in range(4):
        llm.step()
    held = llm.stats().free_pages
    out = llm.abort(ids[1])
    # 4 steps ran; the host has read 3 of their tokens (it trails the device by one step)
    assert out.finished and out.finish_reason == "abort" and len(out.token_ids) == 3
    assert llm.stats().free_pages == held + 2             # 34 keys in pages of 32
    with pytest.raises(KeyError, match="no unfinished request"):
        llm.abort(ids[1])
    finals = llm.run_until_done([ids[0], ids[2]])
    for prompt, final in zip([prompts[0], prompts[2]], finals):
        assert final.token_ids == alone(params, prompt, 12, None).tokens[0]
    assert llm.stats().free_pages == llm.stats().total_pages
