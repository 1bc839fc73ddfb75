"""The serving engine of both frameworks (wise_torch.LLM, wise_jax.LLM over the shared host side
`wise_core.engine`), one test per behaviour run once per framework: requests joining between
steps, chunked prefill, preemption with offload, aborts, seeded sampling, requests that can
never fit. Every equality of tokens is against the framework's `generate` of the prompt alone
(fp32, reference kernel, CPU), whose pool holds the request whole and whose prompt prefills in
one chunk."""

from __future__ import annotations

import pytest

from cases import prompts_of
from engine_cases import FRAMEWORKS, Framework, drained
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_core.wise_config import WiseConfig

CONFIG = PRESETS["test-tiny-gqa"]
PAGE = 32
WISE = WiseConfig(eta=0.5)
MODES = pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])


@pytest.fixture(scope="module", params=FRAMEWORKS)
def fw(request):
    return Framework(request.param, CONFIG, seed=0)


def engine(fw, wise_config=None, **kw):
    kw = {"num_pages": 64, "page_size": PAGE, "max_num_seqs": 8, "max_model_len": 256,
          "attention_backend": "reference", **kw}
    return fw.engine(wise_config=wise_config, **kw)


@MODES
def test_requests_joining_between_steps_get_their_tokens_alone(fw, wise_config):
    prompts = prompts_of([70, 3, 129, 40, 17], CONFIG.vocab_size, seed=1)
    news = [9, 14, 5, 11, 8]
    llm = engine(fw, wise_config, max_num_batched_tokens=64)   # long prompts prefill in chunks
    ids, produced, step = {}, {}, 0
    while len(ids) < len(prompts) or llm.has_unfinished():
        if step % 3 == 0 and len(ids) < len(prompts):           # a new request every third step
            i = len(ids)
            ids[llm.add_request(prompts[i], SamplingParams(max_tokens=news[i], ignore_eos=True))] = i
        for out in llm.step():
            produced[ids[out.request_id]] = out
        step += 1
    for i, prompt in enumerate(prompts):
        assert produced[i].finished and produced[i].finish_reason == "length"
        assert produced[i].token_ids == fw.alone(prompt, news[i], wise_config, page_size=PAGE)
        assert produced[i].prompt_token_ids == prompt
    stats = drained(llm)
    assert stats.preemptions == 0
    if wise_config is not None:
        assert stats.fallbacks == 0 and all(0 < d < 1 for d in stats.density.values()), stats.density


@MODES
def test_a_prompt_longer_than_a_step_prefills_in_chunks_with_the_unchunked_tokens(fw, wise_config):
    """150 prompt tokens at 40 a step: four chunks, three of them starting mid-page."""
    prompt = prompts_of([150], CONFIG.vocab_size, seed=2)[0]
    llm = engine(fw, wise_config, max_num_batched_tokens=40)
    rid = llm.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    seq, cached = llm.sequences[rid], []
    while not seq.prefilled:
        llm.step()
        cached.append(seq.num_cached)
    assert cached == [40, 80, 120, 150]
    assert llm.run_until_done([rid])[0].token_ids == fw.alone(prompt, 8, wise_config, page_size=PAGE)
    assert drained(llm).prompt_tokens == 150


@MODES
def test_preemption_offloads_and_resumes_with_the_same_tokens(fw, wise_config):
    prompts = prompts_of([60, 50, 45, 33], CONFIG.vocab_size, seed=3)
    llm = engine(fw, wise_config, num_pages=8)          # 8 pages of 32: the four cannot all grow
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    stats = drained(llm)
    assert stats.preemptions > 0 and stats.total_pages == 8
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == fw.alone(prompt, 40, wise_config, page_size=PAGE)
    if wise_config is not None:
        assert stats.fallbacks == 0


def test_seeded_sampling_survives_preemption_and_does_not_depend_on_the_batch(fw):
    prompts = prompts_of([60, 50, 45, 33], CONFIG.vocab_size, seed=4)
    sampling = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    tight = engine(fw, num_pages=8)
    together = tight.generate(prompts, sampling, use_tqdm=False)
    assert drained(tight).preemptions > 0
    for prompt, params, out in zip(prompts, sampling, together):
        assert out.token_ids == engine(fw).generate([prompt], params, use_tqdm=False)[0].token_ids
    other = engine(fw).generate([prompts[0]], sampling[1], use_tqdm=False)[0]
    assert other.token_ids != together[0].token_ids


def test_abort_frees_pages_and_leaves_the_others_unchanged(fw):
    prompts = prompts_of([40, 30, 20], CONFIG.vocab_size, seed=5)
    llm = engine(fw)
    ids = [llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
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
        assert final.token_ids == fw.alone(prompt, 12, None, page_size=PAGE)
    drained(llm)


def test_requests_that_never_fit_are_named_and_leave_nothing(fw):
    llm = engine(fw, num_pages=4, max_model_len=200)
    with pytest.raises(ValueError, match=r"needs 150 prompt \+ 60 new tokens, more than max_model_len \(200\)"):
        llm.add_request([1] * 150, SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match="needs 6 pages of 32 tokens, more than the pool's 4"):
        llm.add_request([1] * 150, SamplingParams(max_tokens=40))     # the pool exhausted by one request
    with pytest.raises(ValueError, match=rf"outside the vocabulary \(size {CONFIG.vocab_size}\)"):
        llm.add_request([1, CONFIG.vocab_size])
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.add_request([])
    with pytest.raises(TypeError, match="integer token ids"):
        llm.add_request([1.5])
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.add_request("text")
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        llm.add_request([1], {"max_tokens": 3})
    drained(llm)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_step_program_build_time_is_not_prefill_or_decode_time(fw):
    """Time the device side reports as building step programs (capture, compile) during a step
    is kept out of prefill_s and decode_s: here every launch 'builds' for 0.3 s."""
    import time

    llm = engine(fw, max_model_len=128)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)   # its real programs built
    llm.reset_stats()
    built = [0.0]
    for name in ("_launch_prefill", "_launch_decode"):
        launch = getattr(llm, name)

        def slow(arg, launch=launch):
            time.sleep(0.3)
            built[0] += 0.3
            return launch(arg)

        setattr(llm, name, slow)
    llm._build_seconds = lambda: built[0]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    stats = drained(llm)
    assert built[0] > 0.85 and stats.prefill_s + stats.decode_s < 0.25, stats
