"""The checks: each runs on a `Suite` and returns one `Result` per (implementation, case, dtype),
with the measured difference and the bound it was held to. `CHECKS` is the registry that
`python -m parity` and the pytest tests both run.

Bounds. Bitwise claims have bound 0 and count the values whose bits differ. Tolerances follow
the one basis of `wise_core.rounding` (unit roundoff, reduction length, LAMBDA):
- attention output vs the float64 spec: `rounding.attention_bound` of each row (its largest |v|,
  its largest scale * |q| * |k|, head_dim, the keys it attends; bf16 runs add the rounding of
  probabilities and output); two implementations: the sum of their bounds;
- block mass vs the spec: `rounding.mass_bound` of the row;
- a support bit may differ only where the selection is decided within rounding: the mass ranked
  before the block is within `rounding.selection_margin` of eta * total, or the block's mass is
  within 2 * delta of another's (delta: the mass bound, 0 for given masses);
- end to end: logits (log-probs when teacher-forced in low precision) within
  `rounding.model_bound` of the model's depth (layers * loops), longest reduction and dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
import traceback
from typing import Callable

import numpy as np

from parity import cases
from parity import fp8, kv_quant
from parity.convert import bits, jax_to_torch, jax_weights, params_differences, tensor_differences, \
    torch_to_jax, torch_weights
from parity.suite import HUGINN_MODEL, Suite
from wise_core import modes as M
from wise_core import reference as ref
from wise_core import rounding
from wise_core import selection as rules
from wise_core.checkpoint import DEFAULT_MODEL

SHOWN = 4  # differences spelled out per result


@dataclasses.dataclass
class Measured:
    """What one comparison found. passed None: skipped (detail says why)."""

    passed: bool | None
    measured: float | None = None
    bound: float | None = None
    unit: str = ""
    detail: str = ""


@dataclasses.dataclass
class Result(Measured):
    """One row of the report: a `Measured` with its labels and run time."""

    check: str = ""
    impl: str = ""
    case: str = ""
    dtype: str = ""
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return {True: "pass", False: "FAIL", None: "skip"}[self.passed]


@dataclasses.dataclass(frozen=True)
class Task:
    """One row to compute: labels, and `measure() -> Measured`."""

    impl: str
    case: str
    dtype: str
    measure: Callable[[], Measured]


@dataclasses.dataclass(frozen=True)
class Check:
    """`tasks(suite)` lists the rows; `run(suite)` computes them. An exception fails its own row
    (with the error as detail) and the run goes on."""

    name: str
    summary: str
    tasks: Callable[[Suite], list[Task]]

    def run(self, suite: Suite) -> list[Result]:
        results = []
        for task in self.tasks(suite):
            start = time.perf_counter()
            try:
                measured = task.measure()
            except Exception as e:  # a crash is this row's failure, not the run's
                where = traceback.extract_tb(e.__traceback__)[-1]
                measured = Measured(False, detail=f"{type(e).__name__}: {e} (raised at {where.filename}:{where.lineno})")
            results.append(Result(**dataclasses.asdict(measured), check=self.name, impl=task.impl, case=task.case,
                                  dtype=task.dtype, seconds=time.perf_counter() - start))
        return results


CHECKS: dict[str, Check] = {}


def check(name: str, summary: str):
    """Register `fn(suite) -> iterable of Task` as the check `name`."""
    def register(fn):
        CHECKS[name] = Check(name, summary, lambda suite: list(fn(suite)))
        return fn
    return register


def bitwise(pairs: list[tuple[str, np.ndarray, np.ndarray]]) -> Measured:
    """Bitwise comparisons (label, got, want): measured = values whose bits differ."""
    lines, count = [], 0
    for label, got, want in pairs:
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            lines.append(f"{label}: shape {got.shape} vs {want.shape}")
            count += max(got.size, want.size)
            continue
        differ = bits(got) != bits(want)
        if differ.any():
            with np.errstate(invalid="ignore"):   # inf - inf in the largest difference: NaN
                largest = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))
            count += int(differ.sum())
            where = [int(i) for i in np.argwhere(differ)[0]]
            lines.append(f"{label}: {int(differ.sum())} of {differ.size} values differ, first at {where} "
                         f"({got[tuple(where)]!r} vs {want[tuple(where)]!r}), max |diff| {largest:.3g}")
    detail = "; ".join(lines[:SHOWN]) if lines else "bitwise identical: " + ", ".join(p[0] for p in pairs)
    return Measured(count == 0, count, 0, "values differing", detail)


# -- support differences -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SupportDifference:
    """A block selected by one side only. before: mass ranked before the block (spec order);
    threshold: eta * total; tie: distance to the nearest other block's mass."""

    row: tuple[int, ...]
    block: int
    kept: bool          # by the implementation (the spec did the opposite)
    before: float
    threshold: float
    tolerance: float
    tie: float
    tie_tolerance: float

    @property
    def straddle(self) -> float:
        return abs(self.before - self.threshold)

    @property
    def explained(self) -> bool:
        return self.straddle <= self.tolerance or self.tie < self.tie_tolerance

    def describe(self) -> str:
        text = (f"row {list(self.row)} block {self.block} {'kept' if self.kept else 'dropped'} (spec: "
                f"{'dropped' if self.kept else 'kept'}): mass ranked before it {self.before:.9g} vs eta*total "
                f"{self.threshold:.9g}, straddle {self.straddle:.3g} (tolerance {self.tolerance:.3g})")
        if self.tie < self.tie_tolerance:
            text += f", within {self.tie:.3g} of another block's mass (tolerance {self.tie_tolerance:.3g})"
        return text


def support_differences(mass: np.ndarray, eta: float, got: np.ndarray, want: np.ndarray,
                        delta: float = 0.0) -> list[SupportDifference]:
    """Blocks where `got` and `want` (bool[..., n_blocks]) disagree, with the margins that tell
    whether rounding can decide them. mass: the spec's masses [..., n_blocks]; delta: the bound
    on each block's mass error (0 when both sides selected from the same masses)."""
    mass = np.asarray(mass, np.float64)
    got, want = np.asarray(got, bool), np.asarray(want, bool)
    out = []
    for row in zip(*np.nonzero((got != want).any(-1))):
        m = mass[row]
        n = m.shape[-1]
        order = np.argsort(-m, kind="stable")
        ranked = m[order]
        before = np.concatenate([[0.0], np.cumsum(ranked)[:-1]])
        rank = np.argsort(order)
        total = float(ranked.sum())
        tolerance = rounding.selection_margin(n, total, delta)
        for block in np.flatnonzero(got[row] != want[row]):
            others = np.delete(m, block)
            tie = float(np.min(np.abs(others - m[block]))) if n > 1 else math.inf
            out.append(SupportDifference(tuple(int(i) for i in row), int(block), bool(got[row][block]),
                                         float(before[rank[block]]), eta * total, tolerance, tie, 2 * delta))
    return out


def support_measured(diffs: list[SupportDifference]) -> Measured:
    """measured = support bits that differ beyond rounding; the differences are listed with margins."""
    unexplained = [d for d in diffs if not d.explained]
    if not diffs:
        return Measured(True, 0, 0, "support bits unexplained", "supports identical")
    kind = f"{len(unexplained)} NOT explained by rounding" if unexplained else "all within rounding of the threshold"
    detail = f"{len(diffs)} support bits differ, {kind}: " + "; ".join(
        d.describe() for d in (unexplained or diffs)[:SHOWN])
    return Measured(not unexplained, len(unexplained), 0, "support bits unexplained", detail)


# -- weights ---------------------------------------------------------------------------------------
def _checkpoint(suite: Suite, model: str, dtype: str) -> Measured:
    want = {name: cases.round_to(x, dtype) for name, x in suite.checkpoint(model).tensors.items()}
    lines = [f"torch {line}" for line in tensor_differences(torch_weights(suite.torch_model(model, dtype)), want)]
    lines += [f"jax {line}" for line in tensor_differences(jax_weights(*suite.jax_model(model, dtype)), want)]
    return Measured(not lines, len(lines), 0, "tensors differing",
                    "; ".join(lines[:SHOWN]) or f"{len(want)} tensors bitwise identical in both frameworks")


@check("checkpoint", "one checkpoint loaded by both frameworks holds the same weights (bitwise)")
def check_checkpoint(suite: Suite):
    for model, dtype in itertools.product(suite.settings.models, cases.DTYPES):
        yield Task("torch|jax", model, dtype, functools.partial(_checkpoint, suite, model, dtype))


def _torch_round_trip(suite: Suite, model: str, dtype: str) -> Measured:
    original = suite.torch_model(model, dtype).state_dict()
    back = jax_to_torch(*torch_to_jax(suite.torch_model(model, dtype)), device=suite.settings.device).state_dict()
    lines = [f"{n}: dtype {back[n].dtype} vs {original[n].dtype}" for n in original
             if n in back and back[n].dtype != original[n].dtype]
    lines += tensor_differences({n: t.float().cpu().numpy() for n, t in back.items()},
                                {n: t.float().cpu().numpy() for n, t in original.items()})
    return Measured(not lines, len(lines), 0, "tensors differing",
                    "; ".join(lines[:SHOWN]) or f"{len(original)} tensors bitwise identical")


def _jax_round_trip(suite: Suite, model: str, dtype: str) -> Measured:
    config, params = suite.jax_model(model, dtype)
    lines = params_differences(torch_to_jax(jax_to_torch(config, params, device=suite.settings.device))[1], params)
    return Measured(not lines, len(lines), 0, "leaves differing",
                    "; ".join(lines[:SHOWN]) or "every params leaf bitwise identical")


@check("convert", "torch state dict <-> JAX params conversion of live weights round-trips bitwise")
def check_convert(suite: Suite):
    model = DEFAULT_MODEL
    for dtype in cases.DTYPES:
        yield Task("torch->jax->torch", model, dtype, functools.partial(_torch_round_trip, suite, model, dtype))
        yield Task("jax->torch->jax", model, dtype, functools.partial(_jax_round_trip, suite, model, dtype))


# -- the selection rule against its specification ------------------------------------------------
def _selection(suite: Suite, name: str) -> Measured:
    spec = suite.selectors["numpy-spec"]
    unexplained, explained, lines = 0, 0, []
    selection_cases = cases.selection_cases()
    for case in selection_cases:
        found = support_differences(case.mass, case.eta, suite.selectors[name](case.mass, case.eta),
                                    spec(case.mass, case.eta))
        bad = [d for d in found if not d.explained]
        unexplained += len(bad)
        explained += len(found) - len(bad)
        lines += [f"{case.name}: {d.describe()}" for d in (bad or found)[:SHOWN]]
    detail = "; ".join(lines[:SHOWN]) or f"identical on {len(selection_cases)} cases"
    if explained and not unexplained:
        detail = f"{explained} bits differ, all within rounding of the threshold: {detail}"
    return Measured(unexplained == 0, unexplained, 0, "support bits unexplained", detail)


@check("selection-spec", "select_blocks of torch and JAX equal wise_core.reference.select_blocks on "
                         "identical float32 masses (random and adversarial), except within rounding")
def check_selection_spec(suite: Suite):
    for name in suite.selectors:
        if name != "numpy-spec":
            yield Task(f"{name} vs numpy-spec", "random+adversarial", "float32",
                       functools.partial(_selection, suite, name))


def _rule_vs_spec(suite: Suite, name: str, rule) -> Measured:
    """Support bits of `name`'s select_blocks(mass, rule) that differ from the numpy spec's on every
    selection case's masses. TopK has no sum: bitwise. Threshold compares each mass with
    fraction * total, total a float32 sum of n_blocks masses in any order: a bit may differ only
    where the block's mass lies within `rounding.selection_margin` of that."""
    spec = suite.selectors["numpy-spec"]
    unexplained, explained, lines = 0, 0, []
    selection_cases = cases.selection_cases()
    for case in selection_cases:
        got, want = suite.selectors[name](case.mass, rule), spec(case.mass, rule)
        if got.shape != want.shape or got.dtype != bool:
            raise ValueError(f"{case.name}: got {got.dtype}{list(got.shape)}, want bool{list(want.shape)}")
        mass = case.mass.astype(np.float64)
        for *row, block in zip(*np.nonzero(got != want)):
            m = mass[tuple(row)]
            total = float(m.sum())
            near = (isinstance(rule, rules.Threshold)
                    and abs(m[block] - rule.fraction * total) <= rounding.selection_margin(m.size, total))
            explained, unexplained = explained + near, unexplained + (not near)
            lines.append(f"{case.name}: row {row} block {block} {'kept' if got[tuple(row)][block] else 'dropped'} "
                         f"(spec: the opposite), mass {m[block]:.9g}" + (" within rounding of the threshold"
                                                                         if near else ""))
    detail = "; ".join(lines[:SHOWN]) or f"identical on {len(selection_cases)} cases"
    return Measured(unexplained == 0, unexplained, 0, "support bits unexplained", detail)


@check("selection-rules", "the other selection rules (wise_core.selection: top-k, threshold) of torch and JAX "
                          "equal their numpy reference on the selection-spec masses (top-k bitwise)")
def check_selection_rules(suite: Suite):
    for name in suite.selectors:
        if name != "numpy-spec":
            for rule in cases.SELECTION_RULES:
                yield Task(f"{name} vs numpy-spec", rule.describe(), "float32",
                           functools.partial(_rule_vs_spec, suite, name, rule))


def _context_rule_vs_spec(suite: Suite, name: str, rule) -> Measured:
    """Support bits of `name`'s select_blocks(mass, rule, context) that differ from the numpy
    spec's on every selection-context case (a rank-based rule has no sum: bitwise)."""
    spec = suite.selectors["numpy-spec"]
    lines, context_cases = [], cases.selection_context_cases()
    for case in context_cases:
        got, want = suite.selectors[name](case.mass, rule, case.context), spec(case.mass, rule, case.context)
        if got.shape != want.shape or got.dtype != bool:
            raise ValueError(f"{case.name}: got {got.dtype}{list(got.shape)}, want bool{list(want.shape)}")
        lines += [f"{case.name}: row {row} head {head} block {block} {'kept' if got[row, head, block] else 'dropped'} "
                  f"(spec: the opposite)" for row, head, block in zip(*np.nonzero(got != want))]
    detail = "; ".join(lines[:SHOWN]) or f"identical on {len(context_cases)} cases"
    return Measured(not lines, len(lines), 0, "support bits differ", detail)


@check("selection-context", "Custom rules reading a SelectionContext (seq_lens, loop, layer, head, rank; JAX's "
                            "traced) of torch and JAX equal their numpy reference, bitwise")
def check_selection_context(suite: Suite):
    for name in suite.selectors:
        if name != "numpy-spec":
            for rule in cases.CONTEXT_RULES:
                yield Task(f"{name} vs numpy-spec", rule.describe(), "float32",
                           functools.partial(_context_rule_vs_spec, suite, name, rule))


# -- decode calls: all-blocks WISE is dense, bitwise ---------------------------------------------
def _attention_tasks(suite: Suite, measure):
    for impl, case, dtype in itertools.product(suite.impls, suite.settings.attention_cases,
                                               suite.settings.attention_dtypes):
        yield Task(impl.name, case.name, dtype, functools.partial(measure, suite, impl, case, dtype))


def _all_blocks_call(suite: Suite, impl, case, dtype) -> Measured:
    dense = suite.decode(impl, case, dtype, "dense")
    pairs = [(f"{call} vs dense", suite.decode(impl, case, dtype, call).out, dense.out)
             for call in ("sparse-all", "discover", "union")]
    pairs += [(f"{call} support'", suite.decode(impl, case, dtype, call).support,
               suite.call_inputs(case, dtype, call)[1]) for call in ("dense", "sparse-all")]
    return bitwise(pairs)


@check("all-blocks-call", "decode_attention: SPARSE with every causal block, DISCOVER and DISCOVER_UNION "
                          "are bitwise DENSE; DENSE and SPARSE leave the support unchanged")
def check_all_blocks_call(suite: Suite):
    return _attention_tasks(suite, _all_blocks_call)


# -- decode calls: masked attention and selection across frameworks -----------------------------
def row_bounds(suite: Suite, case: cases.AttentionCase, dtype: str, call: str) -> np.ndarray:
    """float64[batch]: `rounding.attention_bound` of each row of a call (SPARSE rows: the keys of
    the largest support among the heads)."""
    modes, support = suite.call_inputs(case, dtype, call)
    low = None if dtype == "float32" else dtype  # bf16: probabilities may enter bf16 dots
    bounds = np.zeros(case.batch)
    for b, n in enumerate(case.seq_lens):
        if modes[b] == M.SPARSE:
            n = min(n, int(support[b].sum(-1).max()) * case.block_size)
        bounds[b] = rounding.attention_bound_of(case.inputs(dtype)["q"][b], *case.row_keys(dtype, b), n_keys=n,
                                                out_dtype=dtype, p_dtype=low)
    return bounds


def worst_row(case: cases.AttentionCase, got: np.ndarray, want: np.ndarray, bounds: np.ndarray) -> Measured:
    """Rows held to their own bounds; reports the row closest to (or furthest over) its bound."""
    err = np.abs(np.asarray(got, np.float64) - want).reshape(len(bounds), -1).max(-1)
    worst = int(np.argmax(err / bounds))
    passed = bool(np.all(err <= bounds))
    detail = f"worst row {worst} ({case.seq_lens[worst]} keys)"
    if not passed:
        detail += f"; rows over their bound: {np.flatnonzero(err > bounds).tolist()}"
    return Measured(passed, float(err[worst]), float(bounds[worst]), "max |diff|", detail)


def _masked_vs_spec(suite: Suite, impl, case, dtype) -> Measured:
    return worst_row(case, suite.decode(impl, case, dtype, "mixed").out, suite.spec(case, dtype, "mixed")[0],
                     row_bounds(suite, case, dtype, "mixed"))


def _masked_pair(suite: Suite, a, b, case, dtype) -> Measured:
    got, want = (suite.decode(i, case, dtype, "mixed").out for i in (a, b))
    return worst_row(case, got, want, 2 * row_bounds(suite, case, dtype, "mixed"))


@check("masked-attention", "identical q, K/V pages and support (mixed DENSE and SPARSE rows): each "
                           "implementation within its bound of the float64 spec, torch vs JAX within twice it")
def check_masked_attention(suite: Suite):
    yield from _attention_tasks(suite, _masked_vs_spec)
    pairs = itertools.product([i for i in suite.impls if i.framework == "torch"],
                              [i for i in suite.impls if i.framework == "jax"])
    for (a, b), case, dtype in itertools.product(pairs, suite.settings.attention_cases,
                                                 suite.settings.attention_dtypes):
        yield Task(f"{a.name}|{b.name}", case.name, dtype, functools.partial(_masked_pair, suite, a, b, case, dtype))


def mass_bounds(case: cases.AttentionCase, dtype: str) -> np.ndarray:
    """float64[batch]: `rounding.mass_bound` of each row (dense: every causal key)."""
    return np.array([rounding.mass_bound_of(case.inputs(dtype)["q"][b], case.row_keys(dtype, b)[0])
                     for b in range(case.batch)])


def _discover_mass(suite: Suite, impl, case, dtype) -> Measured:
    return worst_row(case, suite.decode(impl, case, dtype, "discover").mass, suite.spec(case, dtype, "discover")[1],
                     mass_bounds(case, dtype))


@check("discover-mass", "DISCOVER block mass within its bound of the float64 spec")
def check_discover_mass(suite: Suite):
    return _attention_tasks(suite, _discover_mass)


def _discover_support(suite: Suite, impl, case, dtype) -> Measured:
    found = suite.decode(impl, case, dtype, "discover").support
    spec_mass = suite.spec(case, dtype, "discover")[1]
    want = ref.select_blocks(spec_mass.astype(np.float32), case.eta)
    diffs = []
    for b, delta in enumerate(mass_bounds(case, dtype)):
        diffs += [dataclasses.replace(d, row=(b,) + d.row) for d in support_differences(
            spec_mass[b], case.eta, found[b], want[b], float(delta))]
    measured = support_measured(diffs)
    prior = suite.call_inputs(case, dtype, "union")[1]
    union_wrong = int((suite.decode(impl, case, dtype, "union").support != (prior | found)).sum())
    if union_wrong:
        measured.passed, measured.measured = False, measured.measured + union_wrong
        measured.detail += f"; DISCOVER_UNION: {union_wrong} bits differ from support | selection"
    return measured


@check("discover-support", "DISCOVER selects the spec's support except within rounding of the threshold "
                           "(rows and margins named); DISCOVER_UNION gives support | selection, bitwise")
def check_discover_support(suite: Suite):
    return _attention_tasks(suite, _discover_support)


# -- the fp8 K/V quantization rule: the same bytes in every implementation -------------------------
def _nan_as_one(x: np.ndarray) -> np.ndarray:
    """float32 values with every NaN replaced by one NaN (a dequantized NaN's payload is not
    specified: `wise_core.kv_quant`)."""
    return np.where(np.isnan(x), np.float32(np.nan), x).astype(np.float32)


def _kv_quant(suite: Suite, a: str, b: str, case: kv_quant.KVQuantCase, dtype: str) -> Measured:
    codes_a, scales_a, values_a = suite.quantized(a, case, dtype)
    codes_b, scales_b, values_b = suite.quantized(b, case, dtype)
    pairs = [("codes", codes_a, codes_b), ("scales", scales_a, scales_b)]
    pairs += [(f"dequantize -> {out}", _nan_as_one(values_a[out]), _nan_as_one(values_b[out])) for out in values_a]
    return bitwise(pairs)


@check("kv-quant", "the fp8 K/V quantization rule (wise_core.kv_quant): torch and JAX write the same codes "
                   "(the bytes of an fp8 page) and scales as each other and as the numpy spec, bitwise; "
                   "dequantized values too, NaN payloads aside")
def check_kv_quant(suite: Suite):
    for case, dtype in itertools.product(kv_quant.kv_quant_cases(suite.settings.quick), kv_quant.DTYPES):
        for a, b in (("torch", "jax"), ("torch", "numpy-spec"), ("jax", "numpy-spec")):
            yield Task(f"{a}|{b}" if b != "numpy-spec" else f"{a} vs {b}", case.name, dtype,
                       functools.partial(_kv_quant, suite, a, b, case, dtype))


# -- generation: all-blocks WISE is dense, bitwise ------------------------------------------------
def bitwise_runs(wise, dense) -> Measured:
    """Two generations (`Generated`) bitwise the same: each prompt's tokens, then its logits."""
    pairs = [(f"prompt {i} tokens", np.asarray(w), np.asarray(d)) for i, (w, d) in
             enumerate(zip(wise.tokens, dense.tokens))]
    pairs += [(f"prompt {i} logits", w, d) for i, (w, d) in enumerate(zip(wise.logits, dense.logits))]
    return bitwise(pairs)


def _all_blocks_generate(suite: Suite, impl) -> Measured:
    model, workload = suite.settings.equivalence_model, suite.settings.equivalence_workload
    dense = suite.generate(impl.framework, model, impl.kernel, "dense", workload)
    wise = suite.generate(impl.framework, model, impl.kernel, "all-blocks", workload)
    return bitwise_runs(wise, dense)


@check("all-blocks-generate", "generate with WiseConfig(all_blocks=True) gives dense decode's tokens and "
                              "logits, bitwise")
def check_all_blocks_generate(suite: Suite):
    for impl in suite.impls:
        yield Task(impl.name, suite.settings.equivalence_model, "float32",
                   functools.partial(_all_blocks_generate, suite, impl))


# -- end to end ------------------------------------------------------------------------------------
def logit_bound(dtype: str, scale: float, config, keys: int = 0) -> float:
    """`rounding.model_bound` of a model config (keys: the longest context attended)."""
    return rounding.model_bound(config, scale=scale, keys=keys, dtype=dtype)


def compare_runs(config, torch_run, jax_run, dtype: str, forced: bool) -> Measured:
    """Logits (log-probs when forced) within `logit_bound`, compared up to and including each
    prompt's first divergent token, and the same greedy tokens, except where the two runs part
    on a near-tie: torch's top-2 logit gap there within twice the bound (either order is then
    within rounding)."""
    spans, errs, scale = [], [0.0], 1.0
    for tt, jt, tl, jl in zip(torch_run.tokens, jax_run.tokens, torch_run.logits, jax_run.logits):
        split = next((s for s, (a, b) in enumerate(zip(tt, jt)) if a != b), None)
        n = min(len(tl), len(jl)) if split is None else split + 1
        errs.append(float(np.abs(tl[:n].astype(np.float64) - jl[:n]).max()))
        scale = max(scale, float(np.abs(tl[:n]).max()))
        spans.append(split if split is not None or len(tt) == len(jt) else min(len(tt), len(jt)))
    bound = logit_bound(dtype, scale, config)
    lines, passed = [], bool(max(errs) <= bound)
    for i, at in enumerate(spans):
        if at is None:
            continue
        tt, jt, tl = torch_run.tokens[i], jax_run.tokens[i], torch_run.logits[i]
        top2 = np.sort(tl[at])[-2:] if at < len(tl) else None
        near_tie = bool(top2 is not None and top2[1] - top2[0] <= 2 * bound)
        passed &= near_tie
        lines.append(f"prompt {i} diverges at step {at}: torch {tt[at:at + 1]} vs jax {jt[at:at + 1]}, "
                     + (f"torch's top-2 logit gap there {top2[1] - top2[0]:.3g} " if top2 is not None else "")
                     + ("<= 2 x bound: a near-tie" if near_tie else "NOT a near-tie"))
    if max(errs) > bound:
        lines.append(f"{'log-probs' if forced else 'logits'} differ by {max(errs):.3g} > bound {bound:.3g}")
    tokens = sum(map(len, torch_run.tokens))
    detail = "; ".join(lines[:SHOWN]) or (f"{tokens} forced tokens" if forced else f"{tokens} tokens identical")
    if torch_run.density is not None:
        detail += f"; WISE density torch {_density(torch_run.density)}, jax {_density(jax_run.density)}"
        if not passed:
            detail += ("; if the dense run of this model agrees, a support bit that the frameworks' rounding "
                       "put on different sides of the threshold is the likely cause (see discover-support)")
    return Measured(passed, max(errs), bound, "max |diff| " + ("log-prob" if forced else "logit"), detail)


def _density(density: dict | None) -> str:
    return "/".join(f"{x:.3f}" for x in (density or {}).values() if x is not None) or "n/a"


def _end_to_end(suite: Suite, run) -> Measured:
    config = suite.checkpoint(run.model).config
    if run.dtype == "float32":
        out = [suite.generate(framework, run.model, kernel, run.mode, run.workload)
               for framework, kernel in (("torch", run.torch_kernel), ("jax", run.jax_kernel))]
        return compare_runs(config, *out, run.dtype, False)
    out = [suite.teacher_force(framework, run.model, kernel, run.mode, run.workload, run.dtype)
           for framework, kernel in (("torch", run.torch_kernel), ("jax", run.jax_kernel))]
    return compare_runs(config, *out, run.dtype, True)


@check("end-to-end", "torch and JAX give the same greedy tokens, dense and WISE, logits within the bound "
                     "(float32); teacher-forced log-probs within the bound in low precision")
def check_end_to_end(suite: Suite):
    for run in suite.settings.e2e:
        case = f"{run.model} {run.mode}" + ("" if run.dtype == "float32" else " forced")
        yield Task(run.kernels, case, run.dtype, functools.partial(_end_to_end, suite, run))


# -- Huginn: WISE over core iterations -------------------------------------------------------------
def _huginn_all_blocks(suite: Suite, impl) -> Measured:
    dense = suite.huginn_generate(impl.framework, impl.kernel, "dense")
    wise = suite.huginn_generate(impl.framework, impl.kernel, "all-blocks")
    return bitwise_runs(wise, dense)


@check("huginn-all-blocks", "Huginn: WISE over core iterations with every block selected gives dense decode's "
                            "tokens and logits, bitwise")
def check_huginn_all_blocks(suite: Suite):
    for impl in suite.impls:
        if suite.settings.huginn_every_impl or impl.kernel == "reference":
            yield Task(impl.name, HUGINN_MODEL, "float32", functools.partial(_huginn_all_blocks, suite, impl))


def _huginn_end_to_end(suite: Suite, kernels: tuple[str, str], mode: str) -> Measured:
    runs = [suite.huginn_generate(framework, kernel, mode) for framework, kernel in zip(("torch", "jax"), kernels)]
    return compare_runs(suite.checkpoint(HUGINN_MODEL).config, *runs, "float32", False)


@check("huginn-end-to-end", "Huginn: torch and JAX give the same greedy tokens, dense and WISE over core "
                            "iterations, logits within the bound (float32)")
def check_huginn_end_to_end(suite: Suite):
    for kernels in suite.settings.huginn_kernels:
        for mode in ("dense", "wise"):
            yield Task(f"torch-{kernels[0]}|jax-{kernels[1]}", f"{HUGINN_MODEL} {mode}", "float32",
                       functools.partial(_huginn_end_to_end, suite, kernels, mode))


# -- the fp8 K/V cache: the engines' pages, decode on them, attention over fp8 pages ---------------
def _fp8_pages(suite: Suite, mode: str) -> Measured:
    torch_run, jax_run = (suite.fp8_forced(framework, mode, "fp8") for framework in ("torch", "jax"))
    diff = fp8.compare_pages(torch_run.pages, jax_run.pages)
    wrong = diff.values_far + diff.scales_far
    detail = (f"{diff.codes} of {diff.entries} codes differ ({diff.fraction:.2g}), {diff.values_far} values beyond "
              f"their bound (largest at {diff.largest_ratio:.2g} of it); {diff.scales} of {diff.vectors} scales "
              f"differ, {diff.scales_far} by more than 2**-5 relative; " + "; ".join(diff.lines[:SHOWN]))
    return Measured(wrong == 0, wrong, 0, "values, scales beyond their bounds", detail)


@check("fp8-pages", "the fp8 pages torch's and JAX's engines write for the same model and prompts (prefill, "
                    "decode steps; dense and WISE): dequantized values within both roundings plus 2**-5 of the "
                    "vector's amax, scales within 2**-5 (equal K/V give equal bytes: kv-quant; the frameworks' "
                    "K/V differ by rounding)")
def check_fp8_pages(suite: Suite):
    for mode in suite.settings.fp8_modes:
        yield Task("torch|jax", f"{suite.settings.fp8_model} {mode}", "float32",
                   functools.partial(_fp8_pages, suite, mode))


def _fp8_end_to_end(suite: Suite, mode: str) -> Measured:
    torch_run, jax_run = (suite.fp8_forced(framework, mode, "fp8") for framework in ("torch", "jax"))
    unquantized = suite.fp8_forced("torch", mode, "auto")
    fraction = fp8.compare_pages(torch_run.pages, jax_run.pages).fraction
    config = suite.checkpoint(suite.settings.fp8_model).config
    bound, effect, base = fp8.forced_bound(config, torch_run.logprobs, jax_run.logprobs, unquantized.logprobs,
                                           fraction)
    err = max(float(np.abs(t.astype(np.float64) - j).max()) for t, j in zip(torch_run.logprobs, jax_run.logprobs))
    detail = (f"{sum(map(len, torch_run.logprobs))} forced tokens; bound = model_bound {base:.3g} + sqrt(12 f) E: "
              f"f = {fraction:.3g} codes differ (fp8-pages), E = {effect:.3g} (fp8 against the unquantized "
              f"cache, torch)")
    if torch_run.density is not None and mode == "wise":
        detail += f"; WISE density torch {_density(torch_run.density)}, jax {_density(jax_run.density)}"
    return Measured(err <= bound, err, bound, "max |diff| log-prob", detail)


@check("fp8-end-to-end", "torch's and JAX's engines on fp8 caches, teacher-forced (dense and WISE): log-probs "
                         "within model_bound plus the effect of the codes that differ (parity.fp8.forced_bound)")
def check_fp8_end_to_end(suite: Suite):
    for mode in suite.settings.fp8_modes:
        yield Task("torch-reference|jax-reference", f"{suite.settings.fp8_model} {mode} forced", "float32",
                   functools.partial(_fp8_end_to_end, suite, mode))


def _fp8_decode_vs_spec(suite: Suite, impl, case, dtype) -> Measured:
    out = worst_row(case, suite.decode(impl, case, dtype, "mixed").out, suite.spec(case, dtype, "mixed")[0],
                    row_bounds(suite, case, dtype, "mixed"))
    mass = worst_row(case, suite.decode(impl, case, dtype, "discover").mass, suite.spec(case, dtype, "discover")[1],
                     mass_bounds(case, dtype))
    passed = out.passed and mass.passed
    detail = f"out: {out.detail}; DISCOVER mass: {mass.measured:.3g} <= {mass.bound:.3g} {mass.detail}"
    return Measured(passed, out.measured, out.bound, "max |diff| out", detail if passed else "FAILED " + detail)


@check("fp8-decode", "decode_attention on fp8 pages (codes and scales, quantized by the numpy spec), each "
                     "kernel that reads them: output (mixed DENSE and SPARSE rows) and DISCOVER mass within their "
                     "bounds of the float64 spec over the dequantized pages, torch vs JAX within twice it")
def check_fp8_decode(suite: Suite):
    impls = [impl for impl in suite.impls if impl.reads_fp8()]
    fp8_cases = fp8.fp8_attention_cases(suite.settings.quick)
    for impl, case, dtype in itertools.product(impls, fp8_cases, suite.settings.attention_dtypes):
        yield Task(impl.name, case.name, dtype, functools.partial(_fp8_decode_vs_spec, suite, impl, case, dtype))
    pairs = itertools.product([i for i in impls if i.framework == "torch"], [i for i in impls if i.framework == "jax"])
    for (a, b), case, dtype in itertools.product(pairs, fp8_cases, suite.settings.attention_dtypes):
        yield Task(f"{a.name}|{b.name}", case.name, dtype, functools.partial(_masked_pair, suite, a, b, case, dtype))
