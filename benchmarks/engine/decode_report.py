"""The decode-throughput report of the torch and JAX engine benchmarks: a row per (shape, arm,
repeat) against its roofline, the mean over repeats, the standing against the issue's targets,
and the markdown and plot."""

from __future__ import annotations

from pathlib import Path

from benchmarks import report as rp
from benchmarks.engine import speculative_arms
from benchmarks.engine.arms import ADAPTIVE_ARMS, base_of
from benchmarks.engine.timing import roofline

# The issue's targets: WISE / dense decode tok/s per context, dense share of the roofline per
# context, the batch-1 step time, and the defaults' decode tok/s within this share of the tight arms'.
WISE_TARGETS = {1024: 1.30, 4096: 1.45, 8192: 1.50}
DENSE_SHARE_TARGETS = {1024: 0.75, 4096: 0.80, 8192: 0.80}
BATCH1_STEP_MS = 4.0
DEFAULTS_WITHIN = 0.97


def row_of(spec: dict, result: dict, repeat: int | None, config, args) -> dict:
    row = dict(context=spec["context"], batch=spec["batch"], q_scale=spec["q_scale"], arm=spec["arm"],
               repeat=repeat, status=result["status"])
    if repeat is None:
        return row
    r = result["repeats"][repeat]
    density = {int(k): v for k, v in (r.get("density") or {}).items() if v is not None} or None
    # A speculative arm's roofline is dense decode's (its output is), whatever its draft reads.
    roof = roofline(config, args.dtype, spec["context"], spec["batch"], args.new_tokens,
                    None if speculative_arms.is_spec(spec["arm"]) else density, args.hbm_tbps, spec.get("num_steps"))
    row.update({k: r.get(k) for k in ("decode_tokens_per_s", "ms_per_step", "prefill_s", "decode_tokens",
                                      "decode_steps", "fallbacks", "preemptions", "pages_returned", "counters",
                                      "acceptance_rate", "tokens_per_round", "tokens", "mean_depth")})
    row.update(density=density, roofline_tokens_per_s=roof["tokens_per_s"], roofline_ms_per_step=roof["ms_per_step"],
               roofline_share=r["decode_tokens_per_s"] / roof["tokens_per_s"])
    return row


def summarize(rows: list[dict]) -> list[dict]:
    """Mean over repeats per (shape, arm), with WISE / dense, and per engine arm the requests whose
    greedy tokens (first repeat) differ from the dense arm's."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["repeat"] is not None:
            groups.setdefault((r["context"], r["batch"], r["arm"]), []).append(r)
    out = []
    for (context, batch, arm), rs in groups.items():
        mean = sum(r["decode_tokens_per_s"] for r in rs) / len(rs)
        spec = [r for r in rs if r.get("acceptance_rate") is not None]
        out.append(dict(context=context, batch=batch, arm=arm, decode_tokens_per_s=mean,
                        ms_per_step=sum(r["ms_per_step"] for r in rs) / len(rs),
                        roofline_tokens_per_s=rs[-1]["roofline_tokens_per_s"],
                        roofline_share=mean / rs[-1]["roofline_tokens_per_s"], density=rs[-1]["density"],
                        acceptance_rate=sum(r["acceptance_rate"] for r in spec) / len(spec) if spec else None,
                        tokens_per_round=sum(r["tokens_per_round"] for r in spec) / len(spec) if spec else None,
                        mean_depth=mean_depth(rs)))
    by_key = {(s["context"], s["batch"], s["arm"]): s for s in out}
    tokens = {key: rs[0].get("tokens") for key, rs in groups.items()}
    for s in out:
        dense = by_key.get((s["context"], s["batch"], base_of(s["arm"])))
        s["over_dense"] = s["decode_tokens_per_s"] / dense["decode_tokens_per_s"] if dense else None
        fixed = by_key.get((s["context"], s["batch"], ADAPTIVE_ARMS.get(s["arm"])))
        s["over_fixed"] = s["decode_tokens_per_s"] / fixed["decode_tokens_per_s"] if fixed else None
        mine, reference = (tokens.get((s["context"], s["batch"], arm)) for arm in (s["arm"], "dense"))
        set_acceptance = (speculative_arms.method_and_rate(s["arm"]) or (None, None))[1] is not None
        s["differ"] = None if mine is None or reference is None or set_acceptance else \
            speculative_arms.compare_tokens(reference, mine)["differ"]
    return out


def mean_depth(rows: list[dict]) -> float | None:
    """The mean over repeats of rows' mean decode depth (None where a row has none: not an adaptive arm)."""
    depths = [r.get("mean_depth") for r in rows]
    return None if not depths or None in depths else sum(depths) / len(depths)


def standing(summary: list[dict], architecture: str = "ouro") -> list[dict]:
    """The issue's targets, measured where the run has the numbers: the engine's and the
    speculative arms' (Ouro-1.4B's targets: none for a Huginn run)."""
    if architecture != "ouro":
        return []
    return engine_standing(summary) + speculative_arms.standing(summary)


def engine_standing(summary: list[dict], architecture: str = "ouro") -> list[dict]:
    """The decode targets of a summary's dense and wise arms, tight and default (one definition for
    the torch and JAX benchmarks): dense share of the roofline, the batch-1 step at 1K, WISE /
    dense at the batched shapes (WISE_TARGETS is keyed by context) and at batch 1 (>= 1), and
    each default arm's tok/s within DEFAULTS_WITHIN of its tight arm's. These are the issue's
    targets for Ouro-1.4B; a Huginn run (`architecture`) is held to none."""
    if architecture != "ouro":
        return []
    out = []
    by_key = {(s["context"], s["batch"], s["arm"]): s for s in summary}
    for s in summary:
        shape = f"{s['context']}x{s['batch']}"
        arm = s["arm"]
        if arm in ("dense", "dense-default"):
            share = DENSE_SHARE_TARGETS.get(s["context"], min(DENSE_SHARE_TARGETS.values()))
            if s["batch"] > 1:
                out.append(dict(target=f"{arm} >= {share:.0%} of the roofline", shape=shape,
                                value=s["roofline_share"], met=s["roofline_share"] >= share))
            if s["batch"] == 1 and s["context"] == 1024:
                out.append(dict(target=f"{arm}: batch 1 at 1K <= {BATCH1_STEP_MS} ms/step", shape=shape,
                                value=s["ms_per_step"], met=s["ms_per_step"] <= BATCH1_STEP_MS))
        if arm in ("wise", "wise-default") and s["over_dense"] is not None:
            bound = WISE_TARGETS.get(s["context"], 1.0) if s["batch"] > 1 else 1.0
            out.append(dict(target=f"{arm} / {base_of(arm)} >= {bound:.2f}", shape=shape, value=s["over_dense"],
                            met=s["over_dense"] >= bound))
        tight = by_key.get((s["context"], s["batch"], arm.removesuffix("-default")))
        if arm.endswith("-default") and tight is not None:
            ratio = s["decode_tokens_per_s"] / tight["decode_tokens_per_s"]
            out.append(dict(target=f"{arm} >= {DEFAULTS_WITHIN:.2f} x {tight['arm']}", shape=shape, value=ratio,
                            met=ratio >= DEFAULTS_WITHIN))
    return out


def density_text(density) -> str:
    """A density per reuse depth as '2: 0.287, 3: 0.287'; over more than four depths (Huginn's
    reuse iterations) their mean and range, '2..31: mean 0.201 (0.150 at 31 .. 0.260 at 2)'."""
    items = sorted((density or {}).items())
    if len(items) <= 4:
        return ", ".join(f"{d}: {x:.3f}" for d, x in items)
    low, high = min(items, key=lambda i: i[1]), max(items, key=lambda i: i[1])
    return (f"{items[0][0]}..{items[-1][0]}: mean {sum(x for _, x in items) / len(items):.3f} "
            f"({low[1]:.3f} at {low[0]} .. {high[1]:.3f} at {high[0]})")


def is_huginn(report: dict) -> bool:
    return (report.get("config") or {}).get("architecture") == "huginn"


def run_text(report: dict) -> str:
    """'; DEPTH per token; WISE profile: ...; adaptive depth: ...' of a report's header (each part
    where the report has it)."""
    steps, profile, adaptive = report.get("num_steps"), report.get("wise_profile"), report.get("adaptive_depth")
    parts = ([f"{steps} {'core iterations' if is_huginn(report) else 'loops'} per token"] if steps else []) \
        + ([f"WISE profile: {profile}"] if profile else []) + ([adaptive] if adaptive else [])
    return "".join(f"; {part}" for part in parts)


def targets_section(report: dict) -> list[str]:
    """The report's "Targets" section: the standing, or why a Huginn run has none."""
    lines = ["", "## Targets", ""]
    if is_huginn(report):
        return lines + ["The issue's targets are Ouro-1.4B's; this Huginn run is held to none (the figures above "
                        "are its result)."]
    lines += ["| target | shape | measured | met |", "|---|---|---|---|"]
    for t in report["standing"]:
        lines.append(f"| {t['target']} | {t['shape']} | {t['value']:.2f} | {'yes' if t['met'] else 'no'} |")
    return lines


def table(rows: list[dict]) -> list[str]:
    lines = ["| ctx x batch | q-scale | arm | repeat | decode tok/s | ms/step | roofline tok/s | share | "
             "density | prefill s | fallbacks | preemptions | mean depth |", "|" + "---|" * 13]
    for r in rows:
        head = f"| {r['context']} x {r['batch']} | {r['q_scale']:g} | {r['arm']} |"
        if r["repeat"] is None:
            lines.append(f"{head} | {r['status']} |" + " |" * 8)
            continue
        lines.append(f"{head} {r['repeat'] + 1} | {r['decode_tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
                     f"{r['roofline_tokens_per_s']:.0f} | {r['roofline_share']:.0%} | {density_text(r['density'])} | "
                     f"{rp.fmt(r['prefill_s'], '.2f')} | {rp.fmt(r['fallbacks'], 'd')} | {rp.fmt(r['preemptions'], 'd')} | "
                     f"{rp.fmt(r.get('mean_depth'), '.2f')} |")
    return lines


def markdown(report: dict) -> str:
    env = report.get("environment") or {}
    a = report["args"]
    lines = [f"# Decode throughput ({report['date']})", "",
             f"{env.get('device', '?')}; torch {env.get('torch', '?')}, triton {env.get('triton', '?')}; "
             f"model {report['model']}; {a['dtype']}; kernel {a['kernel']}; {a['new_tokens']} new tokens per request, "
             f"{a['repeats']} repeats after a {a['warmup_tokens']}-token warm-up; page size {a['page_size']}; "
             f"roofline at {a['hbm_tbps']} TB/s{run_text(report)}.", "", "## Every run", ""]
    lines += table(report["rows"])
    flagged = [f"{r['context']} x {r['batch']} {r['arm']} repeat {r['repeat'] + 1}: "
               + ", ".join(([f"{r['fallbacks']} fallbacks"] if r.get("fallbacks") else [])
                           + (["pages not all returned to the pool"] if r.get("pages_returned") is False else []))
               for r in report["rows"] if r["repeat"] is not None
               and (r.get("fallbacks") or r.get("pages_returned") is False)]
    if flagged:
        lines += ["", "Flagged: " + "; ".join(flagged) + "."]
    lines += ["", "## Mean over repeats", "",
              "over dense: decode tok/s over the engine dense arm's (old-wise: over old's). differ: requests "
              "whose greedy tokens differ from the dense arm's. Speculative arms: ms/step is per round, "
              "acceptance the drafts accepted, tok/round the tokens a request commits per round; "
              "spec-METHOD@P arms accept each draft with probability P (timing only: their tokens are not "
              "the model's, differ not counted). Adaptive arms: mean depth the core iterations a decoded token "
              "ran, over fixed their tok/s over the fixed-depth arm's (adaptive, adaptive-regroup: dense; "
              "wise-adaptive: wise); exited rows ride along, so every iteration still runs (adaptive-regroup: "
              "only the rows still running run the later iterations, eager, so on a GPU not comparable with "
              "graph-captured arms), and their tokens are the exits' (differ counts them; not an error).", "",
              "| ctx x batch | arm | decode tok/s | ms/step | share of roofline | over dense | density | differ | "
              "acceptance | tok/round | mean depth | over fixed |", "|" + "---|" * 12]
    for s in report["summary"]:
        lines.append(f"| {s['context']} x {s['batch']} | {s['arm']} | {s['decode_tokens_per_s']:.1f} | "
                     f"{s['ms_per_step']:.2f} | {s['roofline_share']:.0%} | {rp.fmt(s['over_dense'], '.2f')} | "
                     f"{density_text(s['density'])} | {rp.fmt(s.get('differ'), 'd')} | "
                     f"{rp.fmt(s.get('acceptance_rate'), '.3f')} | {rp.fmt(s.get('tokens_per_round'), '.2f')} | "
                     f"{rp.fmt(s.get('mean_depth'), '.2f')} | {rp.fmt(s.get('over_fixed'), '.2f')} |")
    return "\n".join(lines + targets_section(report)) + "\n"


def plot(report: dict, path: Path) -> None:
    """tok/s per arm, one panel per shape, each arm's roofline as a dash over its bar."""
    plt = rp.pyplot()
    shapes = sorted({(s["context"], s["batch"]) for s in report["summary"]})
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), squeeze=False)
    for ax, (context, batch) in zip(axes[0], shapes):
        here = [s for s in report["summary"] if (s["context"], s["batch"]) == (context, batch)]
        xs = range(len(here))
        ax.bar(xs, [s["decode_tokens_per_s"] for s in here], color="tab:blue")
        for x, s in zip(xs, here):
            ax.hlines(s["roofline_tokens_per_s"], x - 0.4, x + 0.4, colors="tab:red", linestyles="dashed")
            ax.text(x, s["decode_tokens_per_s"], f"{s['roofline_share']:.0%}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [s["arm"] for s in here])
        ax.set_title(f"{context} x {batch}")
        ax.set_ylabel("decode tok/s")
    fig.suptitle("decode tok/s (bars; % of roofline) and bandwidth roofline (dashes)")
    fig.tight_layout()
    rp.save_png(fig, path)


def write_report(report: dict, out: Path) -> str:
    """throughput.json, .md and .png in out; the markdown."""
    return rp.write_report(out, "throughput", report, markdown(report), lambda path: plot(report, path))
