"""wise_jax.LLM decodes at a batch bucket (the rows up to the highest occupied slot) and a
context bucket (the page-table width of the longest running row, `wise_core.buckets`), not at
max_num_seqs x max_model_len: the tokens are exactly those of the unbucketed engine (every step
at all rows and max_model_len's width), dense and WISE, fp32, with the reference and the
interpreted Pallas kernels; the compiled steps stay within their bound."""

import numpy as np
import pytest

import wise_jax
from wise_core.checkpoint import random_tensors
from wise_core.config import PRESETS, WiseConfig
from wise_jax import engine as jax_engine
from wise_jax import kv_cache as kvc

CONFIG = PRESETS["test-tiny"]
PAGE = 32
# The first row grows across a page (1 -> 2 pages: rung 1 to 2), the others sit at 3 and 5
# pages (rungs 4 and 8), so one batch spans three rungs; max_model_len 512 is 16 pages. They
# take slots 0, 1, 2 and finish last to first, so the batch bucket goes 4 -> 2 -> 1 while slot
# 0 carries its WISE state across the three.
LENGTHS, BUDGETS = [20, 70, 130], [14, 4, 2]


@pytest.fixture(scope="module")
def params():
    return wise_jax.from_checkpoint_tensors(CONFIG, random_tensors(CONFIG, seed=4, std=0.08))


def run(params, *, bucketed: bool, kernel: str, wise_config=None):
    """Every request's tokens, the (rows, width) its decode steps ran at, and the engine."""
    llm = wise_jax.LLM(params, CONFIG, wise_config=wise_config, num_pages=64, page_size=PAGE, max_num_seqs=4,
                       max_model_len=512, kernel=kernel)
    if not bucketed:
        llm.widths, llm.row_buckets = [llm.max_pages], [4]
    shapes, step = [], jax_engine._step

    def recording(*args, rows, width, **kw):
        shapes.append((rows, width))
        return step(*args, rows=rows, width=width, **kw)
    jax_engine._step = recording
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 256, n).tolist() for n in LENGTHS]
        outs = llm.generate(prompts, [wise_jax.SamplingParams(max_tokens=n, ignore_eos=True) for n in BUDGETS],
                            use_tqdm=False)
    finally:
        jax_engine._step = step
    return [o.token_ids for o in outs], shapes, llm


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
@pytest.mark.parametrize("wise_config", [None, WiseConfig(eta=0.5)], ids=["dense", "wise"])
def test_bucketed_decode_gives_the_unbucketed_tokens(params, kernel, wise_config):
    tokens, shapes, llm = run(params, bucketed=True, kernel=kernel, wise_config=wise_config)
    want, whole, _ = run(params, bucketed=False, kernel=kernel, wise_config=wise_config)
    assert tokens == want
    assert set(whole) == {(4, 16)}
    rows, widths = zip(*shapes)
    assert rows[0] == 4 and rows[-1] == 1 and list(rows) == sorted(rows, reverse=True) and set(rows) == {4, 2, 1}
    # Rung 8 while the 130-token row runs, then 4, then the first row alone: 1 page until it
    # crosses to 2 (20 + 14 keys).
    assert set(widths) == {1, 2, 4, 8} and widths[0] == 8 and widths[-1] == 2
    widths = list(widths)
    first = widths.index(1)
    assert widths[first:] == sorted(widths[first:])
    stats = llm.stats()
    assert stats.step_program_bound == 8 * len(llm.row_buckets) * len(llm.widths) == 8 * 3 * 5
    assert stats.step_programs == len(set(shapes)) <= stats.step_program_bound
    assert stats.pool_sizing == "num_pages=64 as given"
    if wise_config is not None:
        assert stats.fallbacks == 0 and 0 < stats.density[2] < 1


def test_a_step_wider_than_its_bucket_writes_nothing(params):
    """The width is the host's promise; a row that would outgrow it does not fit (no silent
    truncation): the step writes nothing and the engine raises."""
    llm = wise_jax.LLM(params, CONFIG, num_pages=16, page_size=PAGE, max_num_seqs=2, max_model_len=512,
                       kernel="reference")
    llm.widths = [1] + llm.widths   # the ladder starts at 1 page
    request = llm.add_request(list(range(1, 33)), wise_jax.SamplingParams(max_tokens=4, ignore_eos=True))
    context_bucket = jax_engine.context_bucket
    jax_engine.context_bucket = lambda widths, pages: 1   # a broken host: 33 keys at a width of 1 page
    try:
        with pytest.raises(kvc.PoolExhaustedError, match="context bucket"):
            llm.run_until_done([request])
    finally:
        jax_engine.context_bucket = context_bucket


def test_a_free_low_slot_keeps_the_bucket_of_the_highest(params):
    """The batch bucket covers the highest occupied slot, whatever is free below it: with slot
    0 finished first, slot 2 still decodes in a bucket of 4 rows, to the unbucketed tokens."""
    def go(buckets):
        llm = wise_jax.LLM(params, CONFIG, wise_config=WiseConfig(eta=0.5), num_pages=64, page_size=PAGE,
                           max_num_seqs=4, max_model_len=512, kernel="reference")
        if buckets is not None:
            llm.row_buckets = buckets
        shapes, step = [], jax_engine._step

        def recording(*args, rows, **kw):
            shapes.append(rows)
            return step(*args, rows=rows, **kw)
        jax_engine._step = recording
        try:
            rng = np.random.default_rng(2)
            outs = llm.generate([rng.integers(0, 256, n).tolist() for n in LENGTHS],
                                [wise_jax.SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 4, 14)],
                                use_tqdm=False)
        finally:
            jax_engine._step = step
        return [o.token_ids for o in outs], shapes

    tokens, rows = go(None)
    want, _ = go([4])
    assert tokens == want and set(rows) == {4}
