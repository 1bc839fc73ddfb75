"""Each speculative draft kind on the trained built-in model: acceptance, tokens per round, step
costs and tokens equal to dense decode.

Random weights give flat logits, so a draft's acceptance is only meaningful on a trained model:
`ouro-py-3m` (4 shared layers x 4 loops, trained on the Python standard library). Prompts are
the first L tokens of the stdlib's held-out `.py` files (`benchmarks.quality.stdlib_corpus`); each arm
decodes N greedy tokens of every prompt with one engine and reports the acceptance, the tokens
a round commits, the drafts a round proposes, the decode wall time, and the requests whose
tokens differ from the dense arm's (on a CPU in float32 none should; in bfloat16 a near tie may
flip one). Arms: `SpeculativeConfig` kinds with WiseConfig(eta=0.95) where they draft with WISE:

  wise     every loop (discovery 0-1 dense, reuse 2-3 sparse), verified from loop 2
  wise3    loops 0-2 (loop 2 sparse), then the head, verified from loop 2
  wise2    loops 0-1 (discovery 0, reuse 1), then the head, verified from loop 1
  loops2   loops 0-1 dense, then the head, verified from loop 2
  wise-sparse   every loop of a draft token sparse, discovery loops included, on the support its
           request's last verified token discovered (`sparse_discovery=True`); verified from loop 0
  ...-adaptive   the same with a per-request draft count (`SpeculativeConfig(adaptive=True)`)

Step costs: the mean wall time of each kind of device step (`StepTimer`: the device synchronized
after each): a dense decode step, a draft step of each kind ("full": the draft's loops, the
first of a round included; "sparse": a sparse-discovery draft step; "head": a loop draft;
"partial": the loops before the verify depth only) and the verification pass; and the density
the WISE loops read (per reuse depth, averaged; a sparse-discovery draft reads it at every loop).

    python3 -m benchmarks.engine.draft_kinds --out benchmarks/results/cpu-2026-12-05/draft-kinds
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from benchmarks import report as rp
from benchmarks.quality.stdlib_corpus import is_held_out, list_files, stdlib_root

KINDS = ("wise", "wise3", "wise2", "loops2", "wise-sparse")


def arm_config(arm: str, num_draft: int, eta: float):
    """(SpeculativeConfig or None, WiseConfig or None) of an arm name."""
    from wise_core.speculative_config import SpeculativeConfig
    from wise_core.wise_config import WiseConfig
    kind = arm.removesuffix("-adaptive")
    if kind == "dense":
        return None, None
    wise = WiseConfig(eta=eta)
    spec = {"wise": (SpeculativeConfig("wise", num_draft=num_draft), wise),
            "wise3": (SpeculativeConfig("wise", num_draft=num_draft, draft_loops=3), wise),
            "wise2": (SpeculativeConfig("wise", num_draft=num_draft, draft_loops=2),
                      dataclasses.replace(wise, discover_depths=(0,), reuse_depths=(1,))),
            "loops2": (SpeculativeConfig("loops", num_draft=num_draft, draft_loops=2), None),
            "wise-sparse": (SpeculativeConfig("wise", num_draft=num_draft, sparse_discovery=True), wise)}
    if kind not in spec:
        raise SystemExit(f"unknown arm {arm!r}: choose dense or one of {KINDS}, each optionally -adaptive")
    spec = spec[kind]
    return (dataclasses.replace(spec[0], adaptive=True), spec[1]) if arm.endswith("-adaptive") else spec


class StepTimer:
    """Wall time of each kind of device step of an LLM (`ModelRunner.decode_staged` for a dense
    decode step; `Speculator._run` for a draft step, keyed by its kind, and for the verification
    pass), the device synchronized after each so no step overlaps the next."""

    def __init__(self, llm):
        import torch
        self.total, self.count = {}, {}
        self.sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
        if llm.speculator is None:
            self._wrap(llm.runner, "decode_staged", lambda *args: "dense")
        else:
            self._wrap(llm.speculator, "_run", lambda key, fn: "verify" if key[0] == "verify" else key[2])

    def _wrap(self, obj, name: str, kind_of) -> None:
        inner = getattr(obj, name)

        def timed(*args):
            kind, start = kind_of(*args), time.perf_counter()
            out = inner(*args)
            self.sync()
            self.total[kind] = self.total.get(kind, 0.0) + time.perf_counter() - start
            self.count[kind] = self.count.get(kind, 0) + 1
            return out
        setattr(obj, name, timed)

    def ms(self) -> dict[str, float]:
        """Mean milliseconds per step of each kind."""
        return {kind: 1000 * self.total[kind] / self.count[kind] for kind in self.total}


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` held-out stdlib files that long."""
    root, out = stdlib_root(), []
    for rel in list_files(root):
        if is_held_out(rel):
            ids = tokenizer.encode((root / rel).read_text(errors="replace")).ids[:length]
            if len(ids) == length:
                out.append(ids)
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} held-out stdlib files hold {length} tokens")


def run_arm(model, arm: str, batch: list[list[int]], args) -> dict:
    import wise_torch
    spec, wise = arm_config(arm, args.num_draft, args.eta)
    llm = wise_torch.LLM(model, wise_config=wise, speculative_config=spec, max_num_seqs=len(batch),
                         max_model_len=args.length + args.new_tokens, attention_backend=args.kernel)
    params = wise_torch.SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    timer = StepTimer(llm)
    start = time.perf_counter()
    tokens = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    wall = time.perf_counter() - start
    s = llm.stats()
    return dict(arm=arm, tokens=tokens, wall_s=wall, acceptance=s.acceptance_rate, tokens_per_round=s.tokens_per_round,
                drafts_per_round=s.draft_tokens / s.spec_rounds if s.spec_rounds else None,
                density=s.density, step_ms=timer.ms(), steps=dict(timer.count))


def mean_density(density: dict | None) -> float | None:
    values = [x for x in (density or {}).values() if x is not None]
    return sum(values) / len(values) if values else None


def merged_step_ms(outs: list[dict]) -> dict[str, float]:
    """Mean ms per step of each kind over several engine calls (weighted by their step counts)."""
    kinds = dict.fromkeys(k for o in outs for k in o["step_ms"])
    return {k: sum(o["step_ms"].get(k, 0.0) * o["steps"].get(k, 0) for o in outs) /
            sum(o["steps"].get(k, 0) for o in outs) for k in kinds}


def markdown(report: dict) -> str:
    a, env = report["args"], report["environment"]
    lines = [f"# Draft kinds on ouro-py-3m ({report['date']})", "",
             f"{env['cpu']} ({env['device']}), torch {env['torch']}; {a['prompts']} held-out stdlib prompts x "
             f"{a['length']} tokens, {a['new_tokens']} greedy new tokens, batch {a['batch']}, {a['dtype']}, "
             f"num_draft {a['num_draft']}, eta {a['eta']}, kernel {a['kernel']}.", ""]
    if env["device"] == "cpu":
        lines += [f"Timings on a CPU of {env['cpu_count']} cores, shared with other jobs while this ran: "
                  "loaded, comparable only roughly. The reference kernel scores every key and masks, so a "
                  "sparse loop costs what a dense one does here: the step times show the loops and "
                  "verification each kind runs, not what sparse attention saves on a GPU.", ""]
    rows = [(r["arm"], rp.fmt(r["acceptance"], ".3f"), rp.fmt(r["tokens_per_round"], ".2f"),
             rp.fmt(r["drafts_per_round"], ".2f"), rp.fmt(mean_density(r.get("density")), ".3f"),
             ", ".join(f"{kind} {ms:.1f}" for kind, ms in r.get("step_ms", {}).items()) or "-",
             f"{r['differ']} of {len(r['tokens'])}", rp.fmt(r["wall_s"], ".2f"))
            for r in report["rows"]]
    lines += rp.table(["arm", "acceptance", "tokens / round", "drafts / round", "WISE density",
                       "ms per step (kind)", "differ from dense", "decode wall s"], rows)
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--length", type=int, default=256, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=64, help="requests per engine call")
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--eta", type=float, default=0.95)
    p.add_argument("--kernel", default="auto", help="the engine's attention_backend")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--arms", default=",".join(["dense", *KINDS, *(f"{k}-adaptive" for k in KINDS)]))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import torch
    import wise_torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = wise_torch.load_model("ouro-py-3m", dtype=getattr(torch, args.dtype), device=device)
    batch_prompts = prompts(model.tokenizer, args.prompts, args.length)
    rows = []
    for arm in args.arms.split(","):
        outs = [run_arm(model, arm, batch_prompts[i:i + args.batch], args)
                for i in range(0, len(batch_prompts), args.batch)]
        row = dict(outs[0], tokens=[t for o in outs for t in o["tokens"]], wall_s=sum(o["wall_s"] for o in outs))
        dense = rows[0]["tokens"] if rows else row["tokens"]
        row["differ"] = sum(a != b for a, b in zip(dense, row["tokens"]))
        rows.append(row)
        row["step_ms"] = merged_step_ms(outs)
        row["steps"] = {k: sum(o["steps"].get(k, 0) for o in outs) for k in row["step_ms"]}
        print(arm, {k: row[k] for k in ("acceptance", "tokens_per_round", "drafts_per_round", "differ", "wall_s",
                                        "step_ms")}, flush=True)
    report = dict(date=rp.now(), environment=rp.environment("torch"),
                  args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, rows=rows)
    print(rp.write_report(args.out, "draft_kinds", report, markdown(report)))
    return report


if __name__ == "__main__":
    main()
