"""The speculative-decoding arms of the throughput benchmark (`benchmarks/engine/throughput.py`).

`--spec wise|wise2|wise-sparse|loops --num-draft K [--draft-loops D] [--adaptive-draft]` adds the
arm `spec-wise`, `spec-wise2`, `spec-wise-sparse` or `spec-loops`: the engine with
`SpeculativeConfig(method, num_draft=K, draft_loops=D, adaptive=...)` (spec-wise drafts with the
run's `WiseConfig(eta)`; spec-wise2 with 2-loop WISE drafts, `WiseConfig(discover_depths=(0,),
reuse_depths=(1,))` and draft_loops 2, verified from loop 1; spec-wise-sparse with the run's
WiseConfig and `sparse_discovery=True`: every loop of a draft token sparse on its request's last
verified token's support, verified from loop 0), timed like every engine arm. Per repeat it reports the
acceptance rate and tokens per verification round of that cohort (differences of the engine's
counters around it), and whether its greedy tokens equal the dense arm's token for token (the
number of requests that differ). The issue's target: lossless speculation >= 1.15x dense decode
tok/s at 4K and 8K context while equal to dense.

`--accept-rate P[,P...]` times speculation at a set acceptance instead (random weights give flat
logits, so a real draft is almost never accepted): each speculative arm becomes `spec-METHOD@P`
per P, the engine under `set_acceptance(llm, P)`, which runs its real drafts and its real
verification pass but accepts each draft token with probability P (a seeded Bernoulli prefix). Its tokens are then not the model's (not compared with dense's); its speed is what a
model accepting that often would get. Targets: spec-wise@0.971 (the built-in model's measured
WISE-draft acceptance) >= 1.15x dense at 4K and 8K context and >= 1.3x at batch 1-4;
spec-loops@0.706 (its 2-loop-draft acceptance) >= 1.1x.
"""

from __future__ import annotations

SPEC_ARMS = {"spec-wise": "wise", "spec-wise2": "wise2", "spec-wise-sparse": "wise-sparse", "spec-loops": "loops"}
SPEC_TARGETS = {4096: 1.15, 8192: 1.15}          # speculative / dense decode tok/s
SET_TARGETS = {("wise", 0.971): (1.15, 1.3), ("loops", 0.706): (1.1, 1.1)}   # (4K and 8K, batch <= 4)
_COUNTERS = ("spec_rounds", "draft_tokens", "accepted_tokens", "decode_tokens")


def method_and_rate(arm: str) -> tuple[str, float | None] | None:
    """(method, set acceptance or None) of a speculative arm name, None for any other arm."""
    name, _, rate = arm.partition("@")
    if name not in SPEC_ARMS:
        return None
    return SPEC_ARMS[name], float(rate) if rate else None


def is_spec(arm: str) -> bool:
    return method_and_rate(arm) is not None


def add_arguments(parser) -> None:
    """The benchmark's speculation flags."""
    parser.add_argument("--spec", choices=sorted(set(SPEC_ARMS.values())), action="append", default=[],
                        help="add the lossless speculative arm spec-METHOD (repeatable)")
    parser.add_argument("--num-draft", type=int, default=4, help="drafts per speculative round")
    parser.add_argument("--draft-loops", type=int, default=None,
                        help="loops of the 'loops' draft (default: half the model's loops)")
    parser.add_argument("--adaptive-draft", action="store_true",
                        help="each request chooses its drafts per round from its acceptance "
                             "(SpeculativeConfig(adaptive=True))")
    parser.add_argument("--accept-rate", default="",
                        help="comma-separated set acceptances: time each speculative arm at each "
                             "(spec-METHOD@P; its tokens are not the model's)")


def arms_of(args) -> list[str]:
    """The speculative arms the flags ask for, checked."""
    if args.num_draft < 1:
        raise SystemExit(f"--num-draft must be >= 1, got {args.num_draft}")
    if args.draft_loops is not None and "loops" not in args.spec:
        raise SystemExit("--draft-loops applies to --spec loops")
    try:
        rates = [float(p) for p in args.accept_rate.split(",") if p.strip()]
    except ValueError:
        raise SystemExit(f"--accept-rate takes comma-separated probabilities, got {args.accept_rate!r}") from None
    if any(not 0.0 <= p <= 1.0 for p in rates):
        raise SystemExit(f"--accept-rate values must lie in [0, 1], got {args.accept_rate!r}")
    if rates and not args.spec:
        raise SystemExit("--accept-rate applies to the speculative arms (--spec)")
    methods = dict.fromkeys(args.spec)
    return [f"spec-{m}@{p:g}" for m in methods for p in rates] if rates else [f"spec-{m}" for m in methods]


def engine_kwargs(arm: str, spec: dict) -> dict:
    """`LLM` keyword arguments of a speculative arm from the worker's spec (num_draft,
    draft_loops, eta; the worker passes the spec's kernel as attention_backend, and sets a
    spec-METHOD@P arm's acceptance on the engine it builds, `set_acceptance`)."""
    from wise_core.speculative_config import SpeculativeConfig
    from wise_core.wise_config import WiseConfig
    method, _ = method_and_rate(arm)
    common = dict(num_draft=spec["num_draft"], adaptive=spec.get("adaptive_draft", False))
    if method == "wise2":
        return dict(speculative_config=SpeculativeConfig("wise", draft_loops=2, **common),
                    wise_config=WiseConfig(eta=spec["eta"], discover_depths=(0,), reuse_depths=(1,)))
    if method == "wise-sparse":
        return dict(speculative_config=SpeculativeConfig("wise", sparse_discovery=True, **common),
                    wise_config=WiseConfig(eta=spec["eta"]))
    return dict(speculative_config=SpeculativeConfig(method, draft_loops=spec.get("draft_loops"), **common),
                wise_config=WiseConfig(eta=spec["eta"]) if method == "wise" else None)


def set_acceptance(llm, rate: float, seed: int = 0) -> None:
    """Time `llm`'s speculation (a wise_torch.LLM with speculative_config) at a set acceptance:
    each draft token is accepted with probability `rate`, a Bernoulli draw from numpy's
    generator seeded with `seed` (drawn per round as [rows, num_draft] in the round's row order,
    accepted as a prefix), instead of by the dense model's agreement. The drafts and the
    verification pass run as in a real round, so a round costs what a real one does, but the
    output is not the model's: accepted drafts are kept whatever the model says, and the token
    after them is the verification's greedy token. Through the engine's measurement hook
    `Speculator.set_acceptance`; no engine option sets it."""
    import numpy as np
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"a set acceptance must be a probability in [0, 1], got {rate!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"the set acceptance's seed must be a non-negative integer, got {seed!r}")
    if getattr(llm, "speculator", None) is None:
        raise ValueError("a set acceptance times speculative rounds: the engine has no speculative_config")
    llm.speculator.set_acceptance = (float(rate), np.random.default_rng(seed))


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
        kind = method_and_rate(s["arm"])
        if kind is None:
            continue
        shape = f"{s['context']}x{s['batch']}"
        if kind[1] is not None:   # a set acceptance: speed targets only, its tokens are not the model's
            long, small = SET_TARGETS.get(kind, (None, None))
            bound = long if s["context"] in SPEC_TARGETS else small if s["batch"] <= 4 else None
            if bound is not None and s.get("over_dense") is not None:
                out.append(dict(target=f"{s['arm']} / dense >= {bound:.2f}", shape=shape, value=s["over_dense"],
                                met=s["over_dense"] >= bound))
            continue
        if s["context"] in SPEC_TARGETS and s.get("over_dense") is not None:
            bound = SPEC_TARGETS[s["context"]]
            out.append(dict(target=f"{s['arm']} / dense >= {bound:.2f}", shape=shape, value=s["over_dense"],
                            met=s["over_dense"] >= bound))
        if s.get("differ") is not None:
            out.append(dict(target=f"{s['arm']}: requests whose tokens differ from dense", shape=shape,
                            value=s["differ"], met=s["differ"] == 0))
    return out
