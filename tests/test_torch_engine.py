"""wise_torch.LLM: continuous batching, chunked prefill, preemption, aborts, sampling, errors.

Every equality of tokens here is against `wise_torch.generate` run on the prompt alone (fp32,
reference kernel, CPU)."""

import math

import pytest
import torch

import wise_torch as wt
from wise_core.checkpoint import random_tensors
from wise_core.config import PRESETS, WiseConfig
from wise_torch.engine.sampler import sample
from torch_cases import prompts_of

WISE = WiseConfig(eta=0.5, kernel="reference")


@pytest.fixture(scope="module")
def model():
    config = PRESETS["test-tiny-gqa"]
    return wt.from_tensors(config, random_tensors(config, seed=0, std=0.08))


def alone(model, prompt, n, wise_config):
    return wt.generate(model, [prompt], max_new_tokens=n, eos_token_id=None, page_size=32, wise_config=wise_config,
                       kernel="reference").tokens[0]


def engine(model, wise_config=None, **kw):
    kw = {"num_pages": 64, "page_size": 32, "max_num_seqs": 8, "max_model_len": 256, "kernel": "reference", **kw}
    return wt.LLM(model, wise_config=wise_config, **kw)


@pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])
def test_requests_joining_between_steps_get_their_tokens_alone(model, wise_config):
    prompts = prompts_of([70, 3, 129, 40, 17], model.config.vocab_size)
    news = [9, 14, 5, 11, 8]
    llm = engine(model, wise_config, max_num_batched_tokens=64)   # long prompts prefill in chunks
    ids, produced, step = {}, {}, 0
    while len(ids) < len(prompts) or llm.has_unfinished():
        if step % 3 == 0 and len(ids) < len(prompts):           # a new request every third step
            i = len(ids)
            ids[llm.add_request(prompts[i], wt.SamplingParams(max_tokens=news[i], ignore_eos=True))] = i
        for out in llm.step():
            produced[ids[out.request_id]] = out
        step += 1
    for i, prompt in enumerate(prompts):
        assert produced[i].finished and produced[i].finish_reason == "length"
        assert produced[i].token_ids == alone(model, prompt, news[i], wise_config)
        assert produced[i].prompt_token_ids == prompt
    stats = llm.stats()
    assert stats.free_pages == stats.total_pages and stats.running == stats.waiting == 0
    if wise_config is not None:
        assert stats.fallbacks == 0 and 0 < stats.density[2] < 1 and stats.density[2] == stats.density[3]


@pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])
def test_preemption_offloads_and_resumes_with_the_same_tokens(model, wise_config):
    prompts = prompts_of([60, 50, 45, 33], model.config.vocab_size, seed=1)
    params = wt.SamplingParams(max_tokens=40, ignore_eos=True)
    llm = engine(model, wise_config, num_pages=8)        # 8 pages of 32: the four cannot all grow
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats.preemptions > 0
    assert stats.free_pages == stats.total_pages == 8
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == alone(model, prompt, 40, wise_config)


def test_abort_frees_pages_and_leaves_the_others_unchanged(model):
    prompts = prompts_of([40, 30, 20], model.config.vocab_size, seed=2)
    llm = engine(model)
    params = wt.SamplingParams(max_tokens=12, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
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
        assert final.token_ids == alone(model, prompt, 12, None)
    assert llm.stats().free_pages == llm.stats().total_pages


def test_step_outputs_stop_tokens_logprobs_and_text():
    llm = wt.LLM("random-tiny", num_pages=16, page_size=32, max_num_seqs=2, kernel="reference")
    a = llm.add_request("hello", wt.SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True))
    assert llm.step() == []                                # the prefill runs; its token is read a step later
    first = llm.step()
    assert [o.request_id for o in first] == [a] and len(first[0].token_ids) == 1
    stop = first[0].token_ids[0]
    b = llm.add_request("hello", wt.SamplingParams(max_tokens=5, stop_token_ids=(stop,)))
    llm.step()
    outs = {o.request_id: o for o in llm.step()}
    assert outs[b].finished and outs[b].finish_reason == "stop" and outs[b].token_ids == [stop]
    final = llm.run_until_done([a])[0]
    assert final.text == llm.tokenizer.decode(final.token_ids)
    assert len(final.logprobs) == 5 and all(lp <= 0 for lp in final.logprobs)
    forced = wt.teacher_force(llm.model, llm.tokenizer.encode("hello").ids, final.token_ids)
    torch.testing.assert_close(torch.tensor(final.logprobs), forced.logprobs[0], atol=1e-5, rtol=0)  # fp32


def test_padding_rows_write_only_the_scratch_page(model):
    llm = engine(model, num_pages=8)
    llm.generate(prompts_of([10, 20, 30], model.config.vocab_size), wt.SamplingParams(max_tokens=3),
                 use_tqdm=False)                           # 3 rows decode at bucket 4
    k = llm.runner.cache.k
    assert not k[:, 3:8].any()                             # pages no request held stay untouched
    assert k[:, llm.runner.cache.scratch_page].any()       # the padding row wrote here


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    prompts = prompts_of([12, 30, 7], model.config.vocab_size, seed=3)
    params = [wt.SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    together = engine(model).generate(prompts, params, use_tqdm=False)
    one = engine(model).generate([prompts[1]], params[1], use_tqdm=False)
    assert together[1].token_ids == one[0].token_ids
    assert together[0].token_ids != engine(model).generate([prompts[0]], params[1], use_tqdm=False)[0].token_ids


def test_sampler_from_tiny_to_huge_temperatures():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 6, generator=g) * 3
    logits[:, 2] += 0.5
    greedy = logits.argmax(-1)
    for t in (1e-30, 1e-10, 1e-6):                         # log space: never overflows, greedy in the limit
        assert torch.equal(sample(logits, [t] * 4000, [wt.SamplingParams()] * 4000, [g] * 4000), greedy)
    row = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5, 3.0]])
    for t in (1.0, 1e3):                                   # the empirical distribution is softmax(row / t)
        drawn = sample(row.expand(20000, 6), [t] * 20000, [wt.SamplingParams()] * 20000, [g] * 20000)
        freq = torch.bincount(drawn, minlength=6).double() / 20000
        want = torch.softmax(row[0].double() / t, -1)
        # 5 binomial standard deviations of a frequency over 20000 draws
        assert bool(((freq - want).abs() <= 5 * (want * (1 - want) / 20000).sqrt() + 1e-12).all()), (t, freq, want)
    def drawn(**filters):
        return set(sample(row.expand(2000, 6), [1.0] * 2000, [wt.SamplingParams(**filters)] * 2000,
                          [g] * 2000).tolist())
    assert drawn(top_p=0.6) == {5} and drawn(top_p=0.7) == {5, 2}   # p(5) = 0.605, p(2) = 0.222
    assert drawn(top_k=3) == {5, 2, 1} and drawn(top_k=1) == {5}
    # min_p 0.3: p >= 0.3 p_max, i.e. logit >= 3 + ln 0.3 = 1.80: tokens 5 and 2
    assert drawn(min_p=0.3) == {5, 2} and drawn(min_p=1.0) == {5}
    # In order: min_p 0.05 keeps 4 tokens (0 and 3 fall below), top_k 3 three of them, top_p 0.8
    # of those renormalised (0.665, 0.245, ...) two.
    assert drawn(min_p=0.05) == {5, 2, 1, 4} and drawn(min_p=0.05, top_k=3, top_p=0.8) == {5, 2}
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0]]).expand(500, 4)             # top_k 1 of a tie: the lower id
    assert set(sample(tied, [1.0] * 500, [wt.SamplingParams(top_k=1)] * 500, [g] * 500).tolist()) == {1}


def test_bad_inputs_are_named(model):
    llm = engine(model, num_pages=4, max_model_len=200)
    with pytest.raises(ValueError, match=r"needs 150 prompt \+ 60 new tokens, more than max_model_len \(200\)"):
        llm.add_request([1] * 150, wt.SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match="needs 6 pages of 32 tokens, more than the pool's 4"):
        llm.add_request([1] * 150, wt.SamplingParams(max_tokens=40))
    with pytest.raises(ValueError, match=r"outside the vocabulary \(size 384\)"):
        llm.add_request([1, 384])
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.add_request([])
    with pytest.raises(TypeError, match="integer token ids"):
        llm.add_request([1.5])
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.add_request("text")
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        llm.add_request([1], {"max_tokens": 3})
    for bad, match in ((dict(max_tokens=0), "max_tokens must be a positive integer"),
                       (dict(temperature=-1.0), "temperature must be >= 0"),
                       (dict(temperature="0.5"), "temperature must be a finite number"),
                       (dict(temperature=math.inf), "temperature must be a finite number"),
                       (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                       (dict(seed=2 ** 70), r"seed must be None or an integer in \[0, 2\*\*63\)"),
                       (dict(ignore_eos="no"), "ignore_eos must be a bool")):
        with pytest.raises(ValueError, match=match):
            wt.SamplingParams(**bad)
    for kw, match in ((dict(num_pages=0), "num_pages must be a positive integer"),
                      (dict(page_size=48, wise_config=WiseConfig()), "page_size must be a multiple of the block_size 32"),
                      (dict(max_model_len=5000), r"exceeds the model's max_position_embeddings \(1024\)"),
                      (dict(cuda_graphs=True), "cuda_graphs=True needs the model on a CUDA device"),
                      (dict(cuda_graphs="yes"), "cuda_graphs must be True, False or 'auto'"),
                      (dict(kernel="pallas"), "'pallas' is not available in wise_torch")):
        with pytest.raises(ValueError, match=match):
            engine(model, **kw)
    with pytest.raises(TypeError, match="wise_config must be a WiseConfig"):
        engine(model, wise_config={"eta": 0.9})
    with pytest.raises(TypeError, match="model must be an OuroForCausalLM"):
        wt.LLM(3)
