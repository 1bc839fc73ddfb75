"""SamplingParams.prompt_logprobs in both engines (vLLM's RequestOutput.prompt_logprobs): each
prompt token's log p, rank and the k most probable tokens against a log_softmax of the model's
full-sequence forward; identical with the prefix cache on and off, with chunked and whole
prefill, beside other requests and under preemption; with n > 1 and speculative decoding; bad
values refused. CPU, fp32, reference kernels; each engine test runs once per framework."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_cases import FRAMEWORKS, Framework, drained
from wise_core.presets import PRESETS
from wise_core.sampling_params import MAX_LOGPROBS, SamplingParams

CONFIG = PRESETS["test-tiny-gqa"]
# Engine (paged, chunked prefill) against the full forward, both fp32: the same sums in other
# orders (attention over pages or one causal call), ~1e-6 relative on logits of size ~1, grown
# through 2 layers x 4 loops; 1e-4 on log p bounds that with room (as the engine tests' logits).
TOL = 1e-4
# One token each (from the prefill): the prompt's scores need no decode step, and the JAX engine
# compiles none.
SCORED = SamplingParams(max_tokens=1, prompt_logprobs=3, logprobs=0)


@pytest.fixture(scope="module", params=FRAMEWORKS)
def model(request):
    return Framework(request.param, CONFIG, seed=3)


def engine(model, **kw):
    return model.engine(**{"num_pages": 32, "page_size": 32, "max_num_seqs": 4, "max_model_len": 256,
                           "attention_backend": "reference", **kw})


def prompt_of(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, n).tolist()


PROMPT = prompt_of(75, 0)       # 2 full pages of 32 and part of a third


def scores(out) -> list[list[tuple[int, float, int]]]:
    """prompt_logprobs as comparable lists: per position [(token, logprob, rank)] in dict order."""
    return [[(t, lp.logprob, lp.rank) for t, lp in entry.items()] for entry in out.prompt_logprobs[1:]]


def assert_close(out, ref) -> None:
    """out's prompt scores are ref's up to TOL (another chunking or batch: sums in other orders):
    the same tokens listed (the top k; ties within TOL are not met by these random weights),
    the prompt tokens' ranks equal."""
    assert len(out.prompt_logprobs) == len(ref.prompt_logprobs)
    for a, b in zip(scores(out), scores(ref)):
        assert a[0][0] == b[0][0] and a[0][2] == b[0][2]
        assert {t for t, _, _ in a} == {t for t, _, _ in b}
        assert max(abs(x[1] - y[1]) for x, y in zip(sorted(a), sorted(b))) < TOL


def test_scores_against_the_full_forward(model):
    """Per prompt token after the first: the token first (log p, rank under a float64
    log_softmax of the forward's logits at the position before), then the k most probable with
    ranks 1..k; k=0 lists the token alone; the generated token and its log p are those of a
    request that does not score its prompt (bitwise: without the prefix cache, whose hit would
    prefill the plain request in another chunking)."""
    llm = engine(model, enable_prefix_caching=False)
    forward = model.forward(PROMPT).astype(np.float64)
    logp = forward - np.log(np.exp(forward).sum(-1, keepdims=True))
    [out] = llm.generate(PROMPT, SCORED, use_tqdm=False)
    pl = out.prompt_logprobs
    assert len(pl) == len(PROMPT) and pl[0] is None
    compared = 0
    for p, entry in enumerate(pl[1:]):
        token, row = PROMPT[p + 1], logp[p]
        ids = list(entry)
        assert ids[0] == token and all(abs(entry[t].logprob - row[t]) < TOL for t in ids)
        assert entry[token].decoded_token is None           # no tokenizer
        # ranks and top ids against float64, where no other token's log p lies within TOL
        near = np.abs(row - row[token]) < TOL
        if near.sum() == 1:
            assert entry[token].rank == int((row >= row[token]).sum())
        order = np.argsort(-row, kind="stable")
        gaps = np.diff(-row[order[:4]])
        if (gaps > TOL).all():
            want = [t for t in order[:3].tolist() if t != token]
            assert ids[1:] == want and [entry[t].rank for t in want] == [order.tolist().index(t) + 1 for t in want]
            compared += 1
        top = [entry[t] for t in ids[1:]]
        assert [e.rank for e in top] == sorted(e.rank for e in top) and len(ids) in (3, 4)
    assert compared > 60
    [zero] = llm.generate(PROMPT, dataclasses.replace(SCORED, prompt_logprobs=0), use_tqdm=False)
    assert [list(e) for e in zero.prompt_logprobs[1:]] == [[t] for t in PROMPT[1:]]
    assert [s[0] for s in scores(zero)] == [s[0] for s in scores(out)]        # bitwise: one computation
    [plain] = llm.generate(PROMPT, dataclasses.replace(SCORED, prompt_logprobs=None), use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert (plain.token_ids, plain.logprobs) == (out.token_ids, out.logprobs)   # bitwise
    [short] = llm.generate(PROMPT[:1], SCORED, use_tqdm=False)
    assert short.prompt_logprobs == [None]
    drained(llm)


def test_the_prefix_cache_does_not_change_them(model):
    """With the prompt's prefix cached by an earlier request, a scoring request takes no cached
    page (its prefill runs whole) and gets, bitwise, an uncached engine's scores and tokens;
    its pages are then cached for later requests."""
    runs = {}
    for caching in (True, False):
        llm = engine(model, enable_prefix_caching=caching)
        llm.generate(PROMPT[:70] + [1, 2, 3], SamplingParams(max_tokens=1), use_tqdm=False)   # caches 2 pages
        hits = llm.stats().prefix_cache_hits
        [out] = llm.generate(PROMPT, SCORED, use_tqdm=False)
        assert llm.stats().prefix_cache_hits == hits                 # nothing taken from the cache
        runs[caching] = (scores(out), out.token_ids, out.logprobs)
        if caching:
            llm.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)
            assert llm.stats().prefix_cache_hits == hits + 64        # a plain request reuses its pages
        drained(llm)
    assert runs[True] == runs[False]


def test_chunked_prefill_gives_the_whole_prompts_scores(model):
    """Chunks of 40 tokens (pages of 32: chunks start inside pages) against one whole prefill;
    and two scoring requests beside a plain one, their chunks sharing steps."""
    whole = engine(model)
    others = [prompt_of(75, 1), prompt_of(75, 2)]
    want = [whole.generate(p, SCORED, use_tqdm=False)[0] for p in [PROMPT] + others]
    llm = engine(model, max_num_batched_tokens=40)
    [got] = llm.generate(PROMPT, SCORED, use_tqdm=False)
    outs = llm.generate([others[0], PROMPT, others[1]], [SCORED, dataclasses.replace(SCORED, prompt_logprobs=None),
                                                         SCORED], use_tqdm=False)
    for out, ref in zip((got, outs[0], outs[2]), want):
        assert_close(out, ref)
    assert outs[1].prompt_logprobs is None
    drained(llm)


def test_preempted_scoring_requests_keep_their_scores(model):
    """A pool too small for both prompts: the second, preempted mid-prefill (its K/V offloaded),
    resumes once the first ends; the scores are those of each request alone."""
    prompts = [prompt_of(100, 4), prompt_of(90, 5)]
    alone = [engine(model).generate(q, SCORED, use_tqdm=False)[0] for q in prompts]
    small = engine(model, num_pages=5, max_model_len=128, max_num_batched_tokens=30)
    together = small.generate(prompts, SCORED, use_tqdm=False)
    assert small.stats().preemptions > 0
    for out, ref in zip(together, alone):
        assert_close(out, ref)
    drained(small)


def test_n_completions_score_the_prompt_once(model):
    """n = 3: the request's prompt_logprobs are a single request's, its completions still share
    the prompt's pages; each completion samples as it would without scoring."""
    llm = engine(model)
    p = dataclasses.replace(SCORED, n=3, temperature=1.0, seed=7)
    [out] = llm.generate(PROMPT, p, use_tqdm=False)
    [single] = llm.generate(PROMPT, SCORED, use_tqdm=False)
    assert len(out.outputs) == 3 and scores(out) == scores(single)
    assert llm.stats().forked_prompt_tokens == 2 * 64
    [plain] = llm.generate(PROMPT, dataclasses.replace(p, prompt_logprobs=None), use_tqdm=False)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in plain.outputs]
    drained(llm)


def test_speculative_decoding_scores_the_prompt():
    """Speculation changes decode only: the prompt's scores are those of an engine without it."""
    import wise_torch
    from wise_core.speculative_config import SpeculativeConfig
    model = Framework("torch", CONFIG, seed=3)
    spec = engine(model, speculative_config=SpeculativeConfig(num_draft=2))
    p = dataclasses.replace(SCORED, max_tokens=8, ignore_eos=True)
    [got] = spec.generate(PROMPT, p, use_tqdm=False)
    [want] = engine(model).generate(PROMPT, p, use_tqdm=False)
    assert isinstance(spec, wise_torch.LLM) and spec.stats().spec_rounds
    assert scores(got) == scores(want) and got.token_ids == want.token_ids
    drained(spec)


def test_bad_values_are_refused():
    for bad in (-1, MAX_LOGPROBS + 1, 1.0, True, "2"):
        with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an integer in \[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(prompt_logprobs=np.int64(2)).prompt_logprobs == 2
    assert type(SamplingParams(prompt_logprobs=np.int64(2)).prompt_logprobs) is int
