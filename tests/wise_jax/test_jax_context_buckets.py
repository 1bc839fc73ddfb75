"""wise_jax.LLM decodes compacted rows (`wise_core.engine.step_plan`) at a batch bucket (the live
rows) and a context bucket (the page-table width of the longest running row,
`wise_core.buckets`), not at max_num_seqs x max_model_len: the tokens are exactly those of the
unbucketed engine (every step at all rows and max_model_len's width), dense and WISE, fp32, with
the reference and the interpreted Pallas kernels; a step may run in a larger compiled bucket
than its own while its own compiles in the background (`wise_jax.engine.compiler`), to the same
tokens, and after the start-up set no step waits for a compile."""

import numpy as np
import pytest

import wise_jax
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_jax.engine import llm as jax_engine

CONFIG = PRESETS["test-tiny"]
PAGE = 32
# The first row grows across a page (1 -> 2 pages: rung 1 to 2), the others sit at 3 and 5
# pages (rungs 4 and 8), so one batch spans three rungs; max_model_len 512 is 16 pages. They
# finish last to first, so the batch bucket goes 4 -> 2 -> 1.
LENGTHS, BUDGETS = [20, 70, 130], [14, 4, 2]


@pytest.fixture(scope="module")
def params():
    return wise_jax.from_checkpoint_tensors(CONFIG, random_tensors(CONFIG, seed=4, std=0.08))


def record_buckets(llm) -> list[tuple[int, int]]:
    """The (rows, width) each decode step of llm runs at, appended as it runs."""
    shapes, choose = [], llm.programs.choose

    def recording(variant, rows, width):
        program, (rows, width) = choose(variant, rows, width)
        shapes.append((rows, width))
        return program, (rows, width)
    llm.programs.choose = recording
    return shapes


def run(params, *, bucketed: bool, attention_backend: str, wise_config=None, lengths=LENGTHS, budgets=BUDGETS, **kw):
    """Every request's tokens, the (rows, width) its decode steps ran at, and the engine."""
    llm = wise_jax.LLM(params, CONFIG, wise_config=wise_config, num_pages=64, page_size=PAGE, max_num_seqs=4,
                       max_model_len=512, attention_backend=attention_backend, **kw)
    if not bucketed:
        llm.widths, llm.row_buckets = [llm.max_pages], [4]
    shapes = record_buckets(llm)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in lengths]
    outs = llm.generate(prompts, [wise_jax.SamplingParams(max_tokens=n, ignore_eos=True) for n in budgets],
                        use_tqdm=False)
    return [o.token_ids for o in outs], shapes, llm


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
@pytest.mark.parametrize("wise_config", [None, WiseConfig(eta=0.5)], ids=["dense", "wise"])
def test_bucketed_decode_gives_the_unbucketed_tokens(params, kernel, wise_config):
    tokens, shapes, llm = run(params, bucketed=True, attention_backend=kernel, wise_config=wise_config)
    want, whole, _ = run(params, bucketed=False, attention_backend=kernel, wise_config=wise_config)
    assert tokens == want
    assert set(whole) == {(4, 16)}
    rows, widths = zip(*shapes)
    # Three rows, then two, then one: the rows of a step are its live requests (the third request
    # takes a 4-row bucket)
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
    # compiled on the step path: each decode bucket once, and so every prefill and first-token program
    assert llm.programs.stats()["compile_blocked_steps"] == len(set(shapes)) and stats.larger_bucket_steps == 0
    sets = (llm.programs, llm.prefill_programs, llm.first_programs)
    assert stats.compile_blocked_steps == sum(p.stats()["compiles"] for p in sets)
    assert stats.pool_sizing == "num_pages=64 as given"
    if wise_config is not None:
        assert stats.fallbacks == 0 and 0 < stats.density[2] < 1


def test_a_step_wider_than_its_bucket_is_refused_on_the_host(params):
    """The width is the host's promise; a plan whose row outgrows it is refused before anything
    runs (no silent truncation)."""
    llm = wise_jax.LLM(params, CONFIG, num_pages=16, page_size=PAGE, max_num_seqs=2, max_model_len=512,
                       attention_backend="reference")
    llm.widths = [1] + llm.widths   # the ladder starts at 1 page
    request = llm.add_request(list(range(1, 33)), wise_jax.SamplingParams(max_tokens=4, ignore_eos=True))
    context_bucket = jax_engine.context_bucket
    jax_engine.context_bucket = lambda widths, pages: 1   # a broken host: 33 keys at a width of 1 page
    try:
        with pytest.raises(ValueError, match="up to 2 pages does not fit 1 rows x 1 pages"):
            llm.run_until_done([request])
    finally:
        jax_engine.context_bucket = context_bucket


def test_a_lone_request_in_a_high_slot_decodes_in_one_row(params):
    """Rows are compacted: with slots 0 and 1 finished first, slot 2 decodes alone in a 1-row
    step (a step sized by the highest slot would run 4), to the unbucketed tokens."""
    tokens, shapes, llm = run(params, bucketed=True, attention_backend="reference", wise_config=WiseConfig(eta=0.5),
                              budgets=[2, 4, 14])
    want, _, _ = run(params, bucketed=False, attention_backend="reference", wise_config=WiseConfig(eta=0.5),
                     budgets=[2, 4, 14])
    assert tokens == want
    rows = [r for r, _ in shapes]
    assert rows[-1] == 1 and rows.count(1) >= 9, rows


@pytest.mark.parametrize("wise_config", [None, WiseConfig(eta=0.5)], ids=["dense", "wise"])
def test_background_compiles_never_stop_a_step_after_the_start_up_set(params, wise_config):
    """With background compiles, once the start-up set (the largest decode bucket, one row at
    each width, the prefill of one prompt at each width, greedy first tokens) is compiled, no step waits for a compile: a
    decode step whose bucket is not compiled yet runs in the smallest compiled bucket holding it,
    and the four prompts prefilled together run one by one in the one-prompt program, to the very
    tokens of an engine compiling every program on the step path, while their own compile off the
    step path. The decode compiles stay within the buckets the steps needed, plus the start-up set."""
    blocking_tokens, blocking_shapes, _ = run(params, bucketed=True, attention_backend="reference",
                                              wise_config=wise_config, background_compile=False)
    llm = wise_jax.LLM(params, CONFIG, wise_config=wise_config, num_pages=64, page_size=PAGE, max_num_seqs=4,
                       max_model_len=512, attention_backend="reference", background_compile=True)
    llm.wait_compiles()   # the start-up set: decode at (4 rows, 16 pages) and (1 row, each width) of the default variant
    startup = {(4, 16)} | {(1, w) for w in llm.widths}
    assert llm.stats().step_programs == len(startup)
    shapes = record_buckets(llm)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in LENGTHS]
    outs = llm.generate(prompts, [wise_jax.SamplingParams(max_tokens=n, ignore_eos=True) for n in BUDGETS],
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == blocking_tokens
    llm.wait_compiles()
    stats, decode = llm.stats(), llm.programs.stats()
    assert stats.compile_blocked_steps == 0 and stats.compile_blocked_s == 0     # decode, prefill, first tokens
    assert decode["larger_bucket_steps"] >= 1
    assert sum(shape != own for shape, own in zip(shapes, blocking_shapes)) == decode["larger_bucket_steps"]
    assert all(r >= own_r and w >= own_w for (r, w), (own_r, own_w) in zip(shapes, blocking_shapes))
    assert stats.step_programs <= len(set(blocking_shapes) | startup)
    llm.close()


def run_in_larger_buckets(programs, grow) -> None:
    """Make every step of `programs` (a `compiler.StepPrograms`) run in a larger bucket than its
    own, as `find` may hand a step while its own compiles: grow(sizes) -> the sizes it runs at."""
    built = {}

    def larger(variant, *sizes):
        key = (variant, *grow(sizes))
        if key not in built:
            built[key] = programs._compile(key)
        return built[key], key[1:]
    programs.find = programs.choose = larger


@pytest.mark.parametrize("chunk_budget", [8192, 64], ids=["whole-prompts", "chunked"])
def test_prefill_and_first_tokens_in_larger_buckets_give_the_same_tokens(params, chunk_budget):
    """A prefill step run in a compiled program of more rows (and a wider page table) than the
    step's, and its first tokens in one of more rows: the step's rows are the program's first,
    the rest padding that writes nothing -- the tokens of an engine running every step in its own
    bucket. (On a GPU the engine met this while a step's own program compiled in the background:
    a one-chunk step in the 16-row prefill program passed 16 rows of logits to the 1-row
    first-token program and failed.)"""
    want, _, _ = run(params, bucketed=True, attention_backend="reference", max_num_batched_tokens=chunk_budget)
    llm = wise_jax.LLM(params, CONFIG, num_pages=64, page_size=PAGE, max_num_seqs=4, max_model_len=512,
                       attention_backend="reference", max_num_batched_tokens=chunk_budget)
    run_in_larger_buckets(llm.prefill_programs,
                          lambda s: (s[0] + 2, s[1], min(2 * s[2], llm.max_pages)))   # (rows, tokens, width)
    run_in_larger_buckets(llm.first_programs, lambda s: (s[0] + 3,))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in LENGTHS]
    outs = llm.generate(prompts, [wise_jax.SamplingParams(max_tokens=n, ignore_eos=True) for n in BUDGETS],
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == want


def test_a_long_prompts_later_chunks_never_wait_for_a_compile_after_the_start_up_set(params):
    """A prompt of 300 tokens in chunks of 64 (2 pages) widens its page table past one chunk: its
    later chunks run in the start-up set's whole-chunk programs at the wider widths (the ones
    of their own lengths compiling in the background), so no step waits, and the tokens are an
    engine's compiling every program on the step path."""
    lengths, budgets = [300, 40], [6, 5]
    want, _, _ = run(params, bucketed=True, attention_backend="reference", lengths=lengths, budgets=budgets,
                     max_num_batched_tokens=64, background_compile=False)
    llm = wise_jax.LLM(params, CONFIG, num_pages=64, page_size=PAGE, max_num_seqs=4, max_model_len=512,
                       attention_backend="reference", max_num_batched_tokens=64, background_compile=True)
    llm.wait_compiles()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in lengths]
    outs = llm.generate(prompts, [wise_jax.SamplingParams(max_tokens=n, ignore_eos=True) for n in budgets],
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    llm.wait_compiles()
    assert llm.prefill_programs.stats()["compile_blocked_steps"] == 0
    assert llm.prefill_programs.stats()["larger_bucket_steps"] >= 1
    llm.close()
