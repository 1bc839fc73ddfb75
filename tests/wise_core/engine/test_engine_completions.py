"""n > 1 completions of one request (`SamplingParams.n`, as vLLM's) in both engines: the prompt
is prefilled once and the completions share its full pages (counted), completion i samples as a
request with seed + i would, and aborts, preemption and the pool's accounting hold. CPU, fp32,
reference kernels; each test runs once per framework."""

from __future__ import annotations

import pytest

from engine_cases import FRAMEWORKS, Framework, drained
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_core.wise_config import WiseConfig
from cases import prompts_of

CONFIG = PRESETS["test-tiny"]
PROMPT = prompts_of([70], CONFIG.vocab_size, seed=4)[0]      # 2 full pages of 32 and 6 tokens


@pytest.fixture(scope="module", params=FRAMEWORKS)
def model(request):
    return Framework(request.param, CONFIG, seed=3)


def engine(model, **kw):
    kw = {"num_pages": 32, "page_size": 32, "max_num_seqs": 8, "max_model_len": 160,
          "attention_backend": "reference", **kw}
    return model.engine(**kw)


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("wise", [None, WiseConfig(eta=0.9)], ids=["dense", "wise"])
def test_seeded_completions_equal_single_requests(model, wise, caching):
    params = SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=11, ignore_eos=True)
    llm = engine(model, wise_config=wise, enable_prefix_caching=caching)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert out.token_ids == out.outputs[0].token_ids
    # Completions 1 and 2 took the 2 full prompt pages of completion 0 (64 tokens each).
    assert drained(llm).forked_prompt_tokens == 2 * 64
    singles = engine(model, wise_config=wise, enable_prefix_caching=caching).generate(
        [PROMPT] * 3, [SamplingParams(max_tokens=10, temperature=0.9, seed=11 + i, ignore_eos=True) for i in range(3)],
        use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1        # the seeds differ, so do the samples


def test_greedy_completions_beside_other_requests_and_preemption(model):
    """n = 3 greedy requests queued with a single one, in a pool too small for all: every
    completion is the greedy single request's tokens."""
    prompts = prompts_of([70, 40], CONFIG.vocab_size, seed=7)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    want = engine(model).generate(prompts, greedy, use_tqdm=False)
    llm = engine(model, num_pages=8, max_num_batched_tokens=48)
    outs = llm.generate(prompts, [SamplingParams(n=3, max_tokens=40, ignore_eos=True), greedy], use_tqdm=False)
    assert [c.token_ids for c in outs[0].outputs] == [want[0].token_ids] * 3
    assert outs[1].outputs[0].token_ids == want[1].token_ids and len(outs[1].outputs) == 1
    s = drained(llm)
    assert s.preemptions > 0 and s.forked_prompt_tokens > 0


def test_a_prompt_shorter_than_a_page_prefills_its_completions_together(model):
    """Nothing to share (no full page short of the last token): the completions do not wait for
    the first one's prefill, and each is a single request's sample."""
    prompt = PROMPT[:20]
    llm = engine(model)
    rid = llm.add_request(prompt, SamplingParams(n=2, max_tokens=4, temperature=0.9, seed=5, ignore_eos=True))
    llm.step()
    assert all(seq.num_cached == 20 for seq in llm._request(rid))     # both prefilled in the first step
    out = llm.run_until_done([rid])[0]
    assert drained(llm).forked_prompt_tokens == 0
    singles = engine(model).generate([prompt] * 2, [SamplingParams(max_tokens=4, temperature=0.9, seed=5 + i,
                                                                   ignore_eos=True) for i in range(2)], use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]


def test_abort_ends_every_completion_and_frees_the_pages(model):
    llm = engine(model)
    rid = llm.add_request(PROMPT, SamplingParams(n=4, max_tokens=30, ignore_eos=True))
    other = llm.add_request(PROMPT[:20], SamplingParams(max_tokens=3))
    for _ in range(4):
        llm.step()
    with pytest.raises(KeyError, match=f"no unfinished request {rid + 1}"):
        llm.abort(rid + 1)                  # a completion's own sequence is not a request
    out = llm.abort(rid)
    assert out.finished and len(out.outputs) == 4
    assert all(c.finish_reason == "abort" and 0 < len(c.token_ids) < 30 for c in out.outputs)
    with pytest.raises(KeyError, match=f"no unfinished request {rid}"):
        llm.abort(rid)
    assert llm.run_until_done([other])[0].finished
    drained(llm)


def test_bad_n_is_refused(model):
    for n in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="SamplingParams.n must be a positive integer"):
            SamplingParams(n=n)
    llm = engine(model)
    with pytest.raises(ValueError, match="SamplingParams.n must be 1"):
        llm.add_request(PROMPT, SamplingParams(n=2), forced=[1, 2])
    drained(llm)
