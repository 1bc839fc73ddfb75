"""No request can harm another, at both engines (wise_torch.LLM, wise_jax.LLM): a request whose
logits turn NaN ends alone (finish_reason "error", its pages freed) while the requests beside it
keep every token of a run without it; a second thread inside an engine is refused; stop ids
outside the vocabulary are refused. Pages and queues are back to empty after every case."""

import threading

import numpy as np
import pytest

from engine_cases import drained
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams

CONFIG = PRESETS["test-tiny"]
BAD = 11                                     # the token whose embedding row is NaN
GOOD = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 1], [6, 2, 2]]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
FRAMEWORKS = ["torch", "jax"]


def tensors() -> dict:
    """Random weights whose embedding of BAD is NaN: a request holding BAD gets NaN logits, any
    other request is untouched."""
    t = random_tensors(CONFIG, seed=3, std=0.08)
    t["model.embed_tokens.weight"][BAD] = np.nan
    return t


def engine(framework: str, **kw):
    kw = {"num_pages": 16, "page_size": 32, "max_model_len": 256, "max_num_seqs": 4, **kw}
    if framework == "torch":
        import wise_torch
        return wise_torch.LLM(wise_torch.from_tensors(CONFIG, tensors()), **kw)
    import wise_jax
    return wise_jax.LLM(wise_jax.from_checkpoint_tensors(CONFIG, tensors()), CONFIG, **kw)


@pytest.fixture(scope="module", params=FRAMEWORKS)
def llm(request):
    return engine(request.param)


@pytest.fixture(scope="module")
def solo(llm):
    """The healthy prompts' tokens, run without any NaN request."""
    return [o.token_ids for o in llm.generate(GOOD, PARAMS, use_tqdm=False)]


def test_nan_logits_in_prefill_fail_that_request_alone(llm, solo):
    outs = llm.generate([GOOD[0], [4, BAD, 8], GOOD[1], GOOD[2]], PARAMS, use_tqdm=False)
    bad = outs[1]
    assert (bad.finish_reason, bad.finished, bad.token_ids) == ("error", True, [])
    assert bad.error == f"the model's logits are NaN for request {bad.request_id}"
    assert [outs[0].token_ids, outs[2].token_ids, outs[3].token_ids] == solo
    assert all(o.finish_reason == "length" and o.error is None for o in outs[:1] + outs[2:])
    drained(llm)


def test_nan_logits_in_decode_fail_that_request_alone_keeping_its_tokens_before(llm, solo):
    """A forced continuation feeds BAD in decode: its third token's logits are NaN, while two
    healthy requests decode in the same steps; the failed request keeps the two tokens before."""
    forced = [7, BAD, 3, 5, 6]
    ids = [llm.add_request(GOOD[0], PARAMS), llm.add_request([2, 3, 4], SamplingParams(max_tokens=5), forced=forced),
           llm.add_request(GOOD[1], PARAMS)]
    outs = llm.run_until_done(ids)
    assert outs[1].finish_reason == "error" and outs[1].token_ids == forced[:2] and "NaN" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == solo[:2]
    drained(llm)


def test_every_completion_of_a_nan_request_fails_and_its_pages_serve_the_next_requests(llm, solo):
    """n = 3 completions of a NaN prompt all fail; then more healthy requests than the pool has
    pages of their own run through the pages the failed ones freed, with their solo tokens."""
    [bad] = llm.generate([[BAD, 1, 2]], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1), use_tqdm=False)
    assert bad.finished and [c.finish_reason for c in bad.completions] == ["error"] * 3
    again = llm.generate(GOOD * 6, PARAMS, use_tqdm=False)    # 18 requests over 16 pages
    assert [o.token_ids for o in again] == solo * 6
    drained(llm)


def test_step_by_step_the_failed_request_is_reported_once_and_gone(llm):
    good, bad = llm.add_request(GOOD[0], PARAMS), llm.add_request([BAD], PARAMS)
    finished = {}
    while llm.has_unfinished():
        for out in llm.step():
            assert out.request_id not in finished
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {good: "length", bad: "error"}
    with pytest.raises(KeyError, match=f"no unfinished request {bad}"):
        llm.output(bad)
    drained(llm)


def test_pages_a_nan_request_left_unscrubbed_harm_no_later_holder(llm):
    """NaN requests aborted between the launch of their prefill and the read of their NaN free
    pages full of NaN K/V, unscrubbed (no NaN was seen). A healthy prompt continuing a cached
    prefix then takes one: its prefill chunk (over the pages it holds) and its decode steps
    read a page whose slots past its keys hold NaN, and it keeps its tokens of a run before."""
    prompt = [20 + i % 50 for i in range(72)]    # 2 full pages cached, the third from the free list
    want = llm.generate([prompt], PARAMS, use_tqdm=False)[0].token_ids
    free, page = len(llm.blocks.free), llm.page_size
    sizes = [min(7, free - 7 * i) for i in range(-(-free // 7))]    # pages of each: every free page
    bad = [llm.add_request([BAD] * (n * page), PARAMS) for n in sizes]
    llm.step()                                   # their prefills launched, not read
    assert not llm.blocks.free
    assert [llm.abort(r).finish_reason for r in bad] == ["abort"] * len(bad)
    got = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert (got.token_ids, got.finish_reason) == (want, "length")
    assert llm.stats().prefix_cache_hits >= 2 * page
    drained(llm)


def test_nan_in_a_speculative_round_fails_that_request_alone():
    """torch's speculative rounds read their own tokens: there too the NaN request ends alone."""
    import wise_torch
    spec = wise_torch.SpeculativeConfig("wise", num_draft=3)
    llm = engine("torch", speculative_config=spec, attention_backend="reference")
    want = [o.token_ids for o in engine("torch").generate(GOOD[:2], PARAMS, use_tqdm=False)]
    ids = [llm.add_request(GOOD[0], PARAMS), llm.add_request([2, 3, 4], SamplingParams(max_tokens=6)),
           llm.add_request(GOOD[1], PARAMS)]
    while llm.stats().spec_rounds == 0:        # the three decode speculatively
        llm.step()
    llm.abort(ids[1])
    bad = llm.add_request([BAD, 2], PARAMS)
    outs = llm.run_until_done([ids[0], ids[2], bad])
    assert [o.token_ids for o in outs[:2]] == want and outs[2].finish_reason == "error"
    drained(llm)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_second_thread_inside_the_engine_is_refused(framework):
    """Thread A's generate is held inside a decode launch; the main thread's add_request, step,
    generate, abort and stats are each a RuntimeError naming both threads; A's tokens are a solo
    run's, and the engine serves the main thread afterwards."""
    llm = engine(framework)
    want = [o.token_ids for o in llm.generate(GOOD[:2], PARAMS, use_tqdm=False)]
    inside, release = threading.Event(), threading.Event()
    launch = llm._launch_decode

    def held_launch(seqs):
        inside.set()
        assert release.wait(60)
        return launch(seqs)

    llm._launch_decode = held_launch
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("out", llm.generate(GOOD[:2], PARAMS, use_tqdm=False)),
                              name="thread-A")
    worker.start()
    try:
        assert inside.wait(60)
        me = threading.current_thread().name
        for call in (lambda: llm.add_request(GOOD[2], PARAMS), llm.step, llm.stats, lambda: llm.abort(0),
                     lambda: llm.generate(GOOD[2], PARAMS, use_tqdm=False)):
            with pytest.raises(RuntimeError, match=f"called from thread '{me}' while thread 'thread-A' is inside "
                                                   "the engine: an engine is not thread-safe"):
                call()
    finally:
        release.set()
        worker.join(60)
    llm._launch_decode = launch
    assert [o.token_ids for o in got["out"]] == want
    assert [o.token_ids for o in llm.generate(GOOD[:2], PARAMS, use_tqdm=False)] == want
    drained(llm)


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    for bad in ([-1], [CONFIG.vocab_size], [3, 2 ** 40]):
        with pytest.raises(ValueError, match=r"SamplingParams.stop_token_ids names token ids \[.*\] outside the "
                                             rf"vocabulary \(size {CONFIG.vocab_size}\)"):
            llm.add_request(GOOD[0], SamplingParams(stop_token_ids=bad))
    drained(llm)
