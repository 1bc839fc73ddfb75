"""wise_core.engine.step_plan: a decode step's compacted rows, and both engines running the same plan."""

from __future__ import annotations

import numpy as np
import pytest

from cases import prompts_of
from engine_cases import Framework
from wise_core.buckets import batch_bucket, context_bucket
from wise_core.engine.sequence import PENDING, Sequence
from wise_core.engine.step_plan import TAG_LIMIT, DecodePlan, TagCounter
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_core.wise_config import WiseConfig

PAGE = 4
SCRATCH = 99


def sequence(slot: int, prompt_len: int, pages: list[int], pending: bool = False) -> Sequence:
    seq = Sequence(request_id=slot, prompt=list(range(1, prompt_len + 1)), params=SamplingParams(max_tokens=8),
                   eos_token_ids=(), arrival=0.0)
    seq.slot, seq.pages = slot, pages
    if pending:
        seq.tokens.append(PENDING)
    return seq


def build(seqs, *, rows=None, width=None, tags=None):
    """The plan of `seqs` at (rows, width), by default their own bucket (`wise_core.buckets`)."""
    rows = batch_bucket([1, 2, 4, 8], len(seqs)) if rows is None else rows
    width = context_bucket([1, 2, 4], max(len(s.pages) for s in seqs)) if width is None else width
    return DecodePlan.build(seqs, rows=rows, width=width, page_size=PAGE, scratch_page=SCRATCH,
                            tags=TagCounter() if tags is None else tags)


def test_rows_are_compacted_in_step_order_whatever_the_sequence_slots():
    """Slots 6 and 2 decode in rows 0 and 1 of a 2-row step (a slot-indexed step would run 8 rows)."""
    a, b = sequence(6, 5, [10, 11]), sequence(2, 8, [20, 21, 22], pending=True)
    plan = build([a, b])
    assert (plan.rows, plan.width, plan.live) == (2, 4, 2)
    np.testing.assert_array_equal(plan.seq_slots, [6, 2])
    np.testing.assert_array_equal(plan.tokens, [5, PENDING])        # a's last prompt token; b's in flight
    np.testing.assert_array_equal(plan.positions, [4, 8])
    np.testing.assert_array_equal(plan.seq_lens, [5, 9])
    # a's position 4 is page 1 (storage 11) offset 0; b's position 8 is page 2 (storage 22) offset 0
    np.testing.assert_array_equal(plan.slot_mapping, [11 * PAGE, 22 * PAGE])
    np.testing.assert_array_equal(plan.page_table, [[10, 11, SCRATCH, SCRATCH], [20, 21, 22, SCRATCH]])
    np.testing.assert_array_equal(plan.tags, [0, 1])


def test_a_larger_bucket_pads_rows_and_columns_on_the_scratch_page():
    seq = sequence(3, 6, [7, 8])
    plan = build([seq], rows=4, width=4)
    assert (plan.rows, plan.width, plan.live) == (4, 4, 1)
    np.testing.assert_array_equal(plan.tags, [0, -1, -1, -1])
    np.testing.assert_array_equal(plan.seq_lens, [6, 1, 1, 1])
    np.testing.assert_array_equal(plan.slot_mapping[1:], [SCRATCH * PAGE] * 3)
    np.testing.assert_array_equal(plan.page_table[1:], np.full((3, 4), SCRATCH))
    np.testing.assert_array_equal(plan.page_table[0], [7, 8, SCRATCH, SCRATCH])
    # the very arrays of the exact bucket, in its rows and columns
    exact = build([sequence(3, 6, [7, 8])])
    for name in ("tokens", "positions", "seq_lens", "slot_mapping", "tags", "seq_slots"):
        np.testing.assert_array_equal(getattr(plan, name)[:exact.rows], getattr(exact, name), err_msg=name)
    np.testing.assert_array_equal(plan.page_table[:exact.rows, :exact.width], exact.page_table)


def test_a_bucket_that_cannot_hold_the_step_is_refused():
    seqs = [sequence(0, 5, [1, 2]), sequence(1, 5, [3, 4])]
    with pytest.raises(ValueError, match="2 rows of up to 2 pages does not fit 1 rows x 4 pages"):
        build(seqs, rows=1, width=4)
    with pytest.raises(ValueError, match="does not fit 2 rows x 1 pages"):
        build(seqs, rows=2, width=1)
    with pytest.raises(ValueError, match="at least one sequence"):
        build([], rows=1, width=1)


def test_tags_are_issued_once_per_token_and_wrap_at_the_int32_limit():
    counter = TagCounter()
    counter.next = TAG_LIMIT - 2
    np.testing.assert_array_equal(counter.issue(3), [TAG_LIMIT - 2, TAG_LIMIT - 1, 0])
    plan = build([sequence(0, 5, [1, 2]), sequence(1, 5, [3, 4])], tags=counter)
    np.testing.assert_array_equal(plan.tags, [1, 2])
    assert plan.tags.dtype == np.int32


def test_both_engines_run_the_same_plans_on_a_staggered_workload(monkeypatch):
    """The torch and JAX engines, given the same requests at the same steps, build the very same
    decode plans (every array of every step), from the one shared `DecodePlan.build`."""
    config = PRESETS["test-tiny"]
    prompts = prompts_of([20, 3, 41, 9], config.vocab_size, seed=5)
    news = [6, 9, 3, 7]
    plans = {}
    real = DecodePlan.build.__func__

    for name in ("torch", "jax"):
        recorded = plans[name] = []

        def recording(cls, *args, recorded=recorded, **kw):
            plan = real(cls, *args, **kw)
            recorded.append(plan)
            return plan

        monkeypatch.setattr(DecodePlan, "build", classmethod(recording))
        llm = Framework(name, config, seed=0).engine(num_pages=32, page_size=32, max_num_seqs=4, max_model_len=128,
                                                     attention_backend="reference", wise_config=WiseConfig())
        added, step = 0, 0
        while added < len(prompts) or llm.has_unfinished():
            if step % 2 == 0 and added < len(prompts):
                llm.add_request(prompts[added], SamplingParams(max_tokens=news[added], ignore_eos=True))
                added += 1
            llm.step()
            step += 1
        monkeypatch.undo()
    torch_plans, jax_plans = plans["torch"], plans["jax"]
    assert len(torch_plans) == len(jax_plans) > 10
    assert {p.rows for p in jax_plans} > {4}, "the batch shrinks: rows follow the live requests, not the slots"
    for step, (t, j) in enumerate(zip(torch_plans, jax_plans)):
        assert (t.rows, t.width, t.live) == (j.rows, j.width, j.live), step
        for name in ("tokens", "positions", "seq_lens", "slot_mapping", "tags", "seq_slots", "page_table"):
            np.testing.assert_array_equal(getattr(t, name), getattr(j, name), err_msg=f"step {step} {name}")
