"""The serving engine of both frameworks on Huginn (test-tiny-huginn with random weights, fp32,
reference kernel, CPU), one test per behaviour run once per framework: requests joining between
steps, chunked prefill, preemption with offload and an abort each give a request the greedy
tokens of its prompt decoded alone through the model's own prefill and decode_step
(`parity.huginn`, the same seeded initial state of each position), dense and with WISE over the
core iterations; the pool's planes follow num_steps; what Huginn cannot run is refused."""

from __future__ import annotations

import dataclasses

import pytest

from cases import prompts_of
from engine_cases import FRAMEWORKS, Framework, drained
from parity.huginn import jax_generate, torch_generate
from wise_core.config import PRESETS, ConfigError, WiseConfig
from wise_core.huginn_reference import num_planes
from wise_core.request import SamplingParams

CONFIG = PRESETS["test-tiny-huginn"]
STEPS = 3           # core iterations of these engines (the preset's default is 4)
PAGE = 32
WISE = WiseConfig(discover_depths=(0,), reuse_depths=(1, 2), eta=0.5, kernel="reference")
MODES = pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])


@pytest.fixture(scope="module", params=[f for f in FRAMEWORKS if f == "torch"])   # wise_jax.LLM: Ouro only
def fw(request):
    return Framework(request.param, CONFIG, seed=0)


def engine(fw, wise_config=None, **kw):
    kw = {"num_pages": 64, "page_size": PAGE, "max_num_seqs": 8, "max_model_len": 256, "kernel": "reference",
          "num_steps": STEPS, **kw}
    return fw.engine(wise_config=wise_config, **kw)


def alone(fw, prompt: list[int], n: int, wise_config) -> list[int]:
    """n greedy tokens of `prompt` alone (memoized per framework): the model's prefill, then its
    decode_step one token a step, STEPS core iterations, the initial state of seed 0 (the
    engine's)."""
    done = fw.__dict__.setdefault("huginn_alone", {})
    key = (tuple(prompt), n, wise_config)
    if key not in done:
        if fw.name == "torch":
            run = torch_generate(fw.model, [prompt], max_new_tokens=n, num_steps=STEPS, wise_config=wise_config)
        else:
            run = jax_generate(fw.model, fw.config, [prompt], max_new_tokens=n, num_steps=STEPS,
                               wise_config=wise_config)
        done[key] = run[0][0]
    return done[key]


def pool_planes(fw, llm) -> int:
    """The planes of the engine's K/V pool."""
    return llm.runner.cache.k.shape[0] if fw.name == "torch" else llm.pool_planes


@MODES
def test_requests_joining_between_steps_get_their_tokens_alone(fw, wise_config):
    prompts = prompts_of([70, 3, 129, 40], CONFIG.vocab_size, seed=1)
    news = [9, 14, 5, 11]
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
        assert produced[i].token_ids == alone(fw, prompt, news[i], wise_config)
    stats = drained(llm)
    assert stats.preemptions == 0
    if wise_config is not None:   # the reuse iterations attend fewer blocks than dense
        assert stats.fallbacks == 0 and all(0 < stats.density[d] < 1 for d in (1, 2)), stats.density


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
    assert llm.run_until_done([rid])[0].token_ids == alone(fw, prompt, 8, wise_config)
    drained(llm)


@MODES
def test_preemption_offloads_and_resumes_with_the_same_tokens(fw, wise_config):
    prompts = prompts_of([60, 50, 45, 33], CONFIG.vocab_size, seed=3)
    llm = engine(fw, wise_config, num_pages=8)          # 8 pages of 32: the four cannot all grow
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    stats = drained(llm)
    assert stats.preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == alone(fw, prompt, 40, wise_config)
    if wise_config is not None:
        assert stats.fallbacks == 0


@MODES
def test_abort_frees_pages_and_leaves_the_others_unchanged(fw, wise_config):
    prompts = prompts_of([40, 30, 20], CONFIG.vocab_size, seed=5)
    llm = engine(fw, wise_config)
    ids = [llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    for _ in range(4):
        llm.step()
    held = llm.stats().free_pages
    out = llm.abort(ids[1])
    assert out.finished and out.finish_reason == "abort"
    assert llm.stats().free_pages == held + 2             # 30 prompt + at most 4 new keys in pages of 32
    finals = llm.run_until_done([ids[0], ids[2]])
    for prompt, final in zip([prompts[0], prompts[2]], finals):
        assert final.token_ids == alone(fw, prompt, 12, wise_config)
    drained(llm)


def test_the_pool_holds_the_planes_of_num_steps_and_wise_depths_are_checked_against_it(fw):
    prompt = prompts_of([20], CONFIG.vocab_size, seed=6)[0]
    for steps in (STEPS, None):    # None: the config's total_ut_steps
        llm = engine(fw, num_steps=steps)
        assert llm.stats().total_pages == 64
        assert pool_planes(fw, llm) == num_planes(CONFIG, steps or CONFIG.total_ut_steps)
    deeper = engine(fw, num_steps=5).generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True),
                                              use_tqdm=False)[0]
    assert deeper.token_ids != alone(fw, prompt, 6, None)    # the depth changes the tokens
    with pytest.raises(ConfigError, match=r"WISE depths \[3\] are out of range for num_steps=3 core iterations"):
        engine(fw, dataclasses.replace(WISE, reuse_depths=(1, 3)))
    with pytest.raises(ValueError, match="num_steps must be a non-negative integer, got -1"):
        engine(fw, num_steps=-1)
