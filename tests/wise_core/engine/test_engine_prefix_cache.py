"""Automatic prefix caching in both engines (`EngineArgs.enable_prefix_caching`, on by default):
requests sharing a prompt prefix share its full pages and skip its prefill, and every request's
tokens are those of an engine without the cache (dense and WISE, with chunked prefill,
preemption and aborts); every page comes back. CPU, fp32, reference kernels; each test runs
once per framework."""

from __future__ import annotations

import numpy as np
import pytest

from engine_cases import FRAMEWORKS, Framework, drained
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_core.wise_config import WiseConfig
from cases import prompts_of

WISE = WiseConfig(eta=0.9)
CONFIG = PRESETS["test-tiny-gqa"]


@pytest.fixture(scope="module", params=FRAMEWORKS)
def model(request):
    return Framework(request.param, CONFIG, seed=3)


def shared_prompts(vocab, n=6, common=75, seed=0):
    """n prompts: one common prefix of `common` tokens (2 full pages of 32 and part of a third),
    then each its own suffix of 5 to 40 tokens."""
    g = np.random.default_rng(seed)
    prefix = g.integers(0, vocab, common).tolist()
    return [prefix + g.integers(0, vocab, 5 + 5 * i).tolist() for i in range(n)]


def run(model, prompts, *, waves=2, abort=None, **kw):
    """Tokens of each prompt, queued in `waves` (a wave after the one before finished, so its
    prefix is cached), and the engine."""
    kw = {"num_pages": 64, "page_size": 32, "max_num_seqs": 8, "max_model_len": 256,
          "attention_backend": "reference", **kw}
    llm = model.engine(**kw)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = {}
    size = -(-len(prompts) // waves)
    for w in range(waves):
        ids = {llm.add_request(p, params): i for i, p in enumerate(prompts[w * size:(w + 1) * size], w * size)}
        if abort is not None and w == waves - 1:
            llm.step()
            llm.abort(next(iter(ids)))
            ids.pop(next(iter(ids)))
        for o in llm.run_until_done(list(ids)):
            out[ids[o.request_id]] = o.token_ids
    drained(llm)
    return [out.get(i) for i in range(len(prompts))], llm


@pytest.mark.parametrize("wise", [None, WISE], ids=["dense", "wise"])
def test_a_cached_prefix_gives_the_uncached_tokens(model, wise):
    prompts = shared_prompts(CONFIG.vocab_size)
    cached, llm = run(model, prompts, wise_config=wise)
    plain, off = run(model, prompts, wise_config=wise, enable_prefix_caching=False)
    assert cached == plain
    s = llm.stats()
    # The first wave prefills the prefix once per request (its pages are registered as each
    # prefill is launched, after the wave was scheduled); the second wave finds 2 pages each.
    assert s.prefix_cache_hits >= 3 * 64 and s.prefix_cache_queries == sum(map(len, prompts))
    assert s.prompt_tokens == sum(map(len, prompts)) - s.prefix_cache_hits
    assert off.stats().prefix_cache_hits == 0 and off.stats().prompt_tokens == sum(map(len, prompts))


def test_with_chunked_prefill_preemption_and_aborts(model):
    prompts = shared_prompts(CONFIG.vocab_size, n=8, seed=1)
    small = dict(num_pages=6, max_num_batched_tokens=40)        # chunks of 40 tokens; too few pages for all
    cached, llm = run(model, prompts, waves=2, abort=True, **small)
    plain, off = run(model, prompts, waves=2, abort=True, enable_prefix_caching=False, **small)
    assert cached == plain and llm.stats().prefix_cache_hits > 0
    assert llm.stats().preemptions > 0 and off.stats().preemptions > 0


def test_identical_prompts_and_one_page_prompts(model):
    vocab = CONFIG.vocab_size
    prompts = [prompts_of([96], vocab, seed=5)[0]] * 3 + prompts_of([32, 5], vocab, seed=6)
    cached, llm = run(model, prompts, waves=3)
    plain, _ = run(model, prompts, waves=3, enable_prefix_caching=False)
    assert cached == plain
    # Waves [96, 96], [96, 32], [5]: the two first prefill together (nothing cached yet), the third
    # reuses 2 of its 3 full pages (its last token is always prefilled), the 32-token prompt none.
    assert llm.stats().prefix_cache_hits == 2 * 32


def test_enable_prefix_caching_must_be_a_bool(model):
    with pytest.raises(TypeError, match="enable_prefix_caching must be a bool"):
        model.engine(num_pages=8, enable_prefix_caching=1)
