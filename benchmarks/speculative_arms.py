"""The speculative-decoding arms of the throughput benchmark (`benchmarks/throughput.py`).

`--spec wise|loops --num-draft K [--draft-loops D]` adds the arm `spec-wise` or `spec-loops`:
the engine with `SpeculativeConfig(method, num_draft=K, draft_loops=D)` (spec-wise drafts with
the run's `WiseConfig(eta, kernel)`), timed like every engine arm. Per repeat it reports the
acceptance rate and tokens per verification round of that cohort (differences of the engine's
counters around it), and whether its greedy tokens equal the dense arm's token for token (the
number of requests that differ). The issue's target: lossless speculation >= 1.15x dense decode
tok/s at 4K and 8K context while equal to dense.
"""

from __future__ import annotations

SPEC_ARMS = {"spec-wise": "wise", "spec-loops": "loops"}
SPEC_TARGETS = {4096: 1.15, 8192: 1.15}          # speculative / dense decode tok/s
_COUNTERS = ("spec_rounds", "draft_tokens", "accepted_tokens", "decode_tokens")


def add_arguments(parser) -> None:
    """The benchmark's speculation flags."""
    parser.add_argument("--spec", choices=sorted(set(SPEC_ARMS.values())), action="append", default=[],
                        help="add the lossless speculative arm spec-METHOD (repeatable)")
    parser.add_argument("--num-draft", type=int, default=4, help="drafts per speculative round")
    parser.add_argument("--draft-loops", type=int, default=None,
                        help="loops of the 'loops' draft (default: half the model's loops)")


def arms_of(args) -> list[str]:
    """The speculative arms the flags ask for, checked."""
    if args.num_draft < 1:
        raise SystemExit(f"--num-draft must be >= 1, got {args.num_draft}")
    if args.draft_loops is not None and "loops" not in args.spec:
        raise SystemExit("--draft-loops applies to --spec loops")
    return [f"spec-{m}" for m in dict.fromkeys(args.spec)]


def engine_kwargs(arm: str, spec: dict) -> dict:
    """`LLM` keyword arguments of a speculative arm from the worker's spec (num_draft,
    draft_loops, eta, kernel)."""
    from wise_core.config import SpeculativeConfig, WiseConfig
    method = SPEC_ARMS[arm]
    return dict(speculative_config=SpeculativeConfig(method, num_draft=spec["num_draft"],
                                                     draft_loops=spec.get("draft_loops")),
                wise_config=WiseConfig(eta=spec["eta"], kernel=spec["kernel"]) if method == "wise" else None)


def counters(stats) -> dict:
    """The speculation counters of an `LLM.stats()`."""
    return {name: getattr(stats, name) for name in _COUNTERS}


def cohort_fields(before: dict, after: dict) -> dict:
    """Acceptance rate and tokens per round of the rounds between two `counters` readings."""
    d = {name: after[name] - before[name] for name in _COUNTERS}
    return dict(acceptance_rate=d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None,
                tokens_per_round=d["decode_tokens"] / d["spec_rounds"] if d["spec_rounds"] else None,
                spec_rounds=d["spec_rounds"], draft_tokens=d["draft_tokens"], accepted_tokens=d["accepted_tokens"])


def compare_tokens(dense: list[list[int]], other: list[list[int]]) -> dict:
    """Requests whose tokens differ from the dense arm's, and where each first differs."""
    if len(dense) != len(other):
        raise ValueError(f"{len(other)} requests against the dense arm's {len(dense)}")
    first = {}
    for i, (a, b) in enumerate(zip(dense, other)):
        if a != b:
            first[i] = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return dict(requests=len(dense), differ=len(first), first_difference=first)


def standing(summary: list[dict]) -> list[dict]:
    """Per speculative arm: its speed target at the contexts of SPEC_TARGETS, and at every shape
    the requests whose greedy tokens differ from the dense arm's (met at 0; in bf16 a near tie
    that two evaluations of the same math order differently also counts)."""
    out = []
    for s in summary:
        if s["arm"] not in SPEC_ARMS:
            continue
        shape = f"{s['context']}x{s['batch']}"
        if s["context"] in SPEC_TARGETS and s.get("over_dense") is not None:
            bound = SPEC_TARGETS[s["context"]]
            out.append(dict(target=f"{s['arm']} / dense >= {bound:.2f}", shape=shape, value=s["over_dense"],
                            met=s["over_dense"] >= bound))
        if s.get("differ") is not None:
            out.append(dict(target=f"{s['arm']}: requests whose tokens differ from dense", shape=shape,
                            value=s["differ"], met=s["differ"] == 0))
    return out
