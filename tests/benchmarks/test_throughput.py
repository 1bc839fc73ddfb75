"""benchmarks/engine/throughput.py and the modules it is made of (arms, workload, timing,
decode_report) on CPU: arguments, the roofline arithmetic, the step-loop timing, the
report, and the pre-engine arms end to end (fresh worker processes) on a tiny model."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import subprocess
import types
from pathlib import Path

import pytest

from benchmarks.engine import arms, decode_report, timing, workload
from benchmarks.engine import throughput as tp

ROOT = Path(__file__).resolve().parents[2]


def test_arguments():
    assert workload.parse_shapes("1024x64, 4096x20") == [(1024, 64), (4096, 20)]
    assert workload.parse_floats("8,7.3,7") == [8.0, 7.3, 7.0]
    assert arms.parse_arms("wise,dense") == ["wise", "dense"]
    for parse, bad in ((workload.parse_shapes, "1024"), (workload.parse_shapes, "0x4"), (workload.parse_shapes, "1kx4"),
                       (workload.parse_floats, "8,x"), (workload.parse_floats, "0"), (workload.parse_floats, "nan"),
                       (arms.parse_arms, "dense,flash"), (arms.parse_arms, "dense,dense")):
        with pytest.raises(Exception):
            parse(bad)
    parser = tp.build_parser()
    args = parser.parse_args(["--shapes", "1024x64,4096x20,8192x10", "--q-scale", "8,7.3,7"])
    assert tp.check_args(parser, args) == [8.0, 7.3, 7.0]
    assert tp.check_args(parser, parser.parse_args(["--q-scale", "7"])) == [7.0] * 3  # one for every shape
    for bad in (["--q-scale", "8,7"], ["--new-tokens", "1"], ["--repeats", "0"], ["--eta", "1.5"],
                ["--num-pages", "10"]):
        with pytest.raises(SystemExit):
            tp.check_args(parser, parser.parse_args(bad))


def test_roofline_reproduces_the_published_numbers():
    from wise_core.presets import PRESETS
    ouro = PRESETS["ouro-1.4b"]
    h, i, layers = 2048, 5632, 24
    per_layer = 4 * h * h + 3 * h * i + 4 * h
    per_loop = layers * per_layer + h + h + 1  # layers, model.norm, the exit gate
    assert timing.weight_bytes_per_step(ouro, "bfloat16", 64) == 2 * (4 * per_loop + 49152 * h + 64 * h)
    # 8 KiB of K and V per token per (loop, layer) plane in bf16, 96 planes.
    assert timing.kv_bytes_per_step(ouro, "bfloat16", 1, 1, None) == 96 * 8192
    assert timing.kv_bytes_per_step(ouro, "bfloat16", 2, 10, {2: 0.5, 3: 0.25}) == 24 * (2 + 0.75) * 2 * 10 * 8192
    # The published roofline ms/step of the Ouro-1.4B shape at 4.3 TB/s, 32 new tokens: 14.5 / 17.4 / 17.4 / 2.5.
    for (context, batch), ms in {(1024, 64): 14.5, (4096, 20): 17.4, (8192, 10): 17.4, (1024, 1): 2.5}.items():
        roof = timing.roofline(ouro, "bfloat16", context, batch, 32, None, 4.3)
        assert roof["ms_per_step"] == pytest.approx(ms, abs=0.05)
        assert roof["tokens_per_s"] == pytest.approx(batch / roof["ms_per_step"] * 1e3)
    sparse = timing.roofline(ouro, "bfloat16", 4096, 20, 32, {2: 0.2, 3: 0.2}, 4.3)
    assert sparse["ms_per_step"] < 17.4 * 0.75
    assert workload.cohort_pages(1024, 64, 32, 128) == 64 * 9


class FakeLLM:
    """Chunked prefill: request r gets its first token at step r + 1, then one token per step."""

    def __init__(self, stop_early: int | None = None):
        self.requests, self.step_no, self.stop_early = {}, 0, stop_early

    def add_request(self, prompt, params):
        rid = len(self.requests)
        self.requests[rid] = dict(prompt=prompt, tokens=[], max=params.max_tokens)
        return rid

    def has_unfinished(self):
        return any(len(r["tokens"]) < r["max"] for r in self.requests.values())

    def step(self):
        self.step_no += 1
        outs = []
        for rid, r in self.requests.items():
            if self.step_no > rid and len(r["tokens"]) < r["max"]:
                r["tokens"].append(7)
                if rid == self.stop_early and len(r["tokens"]) == 2:
                    r["max"] = 2
                outs.append(types.SimpleNamespace(request_id=rid, token_ids=list(r["tokens"]),
                                                  finished=len(r["tokens"]) == r["max"]))
        return outs


def test_step_loop_times_only_tokens_after_the_cohort_has_its_first():
    ticks = iter(range(100))
    result = timing.run_cohort(FakeLLM(), [[1, 2]] * 3, types.SimpleNamespace(max_tokens=5), 5,
                           clock=lambda: float(next(ticks)))
    # Steps at t = 1..7; the last request's first token comes at step 3 (t = 3), when 3 + 2 + 1
    # tokens exist; steps 4..7 give the other 9 in 4 s.
    assert result["prefill_s"] == 3.0 and result["decode_s"] == 4.0
    assert result["decode_tokens"] == 9 and result["decode_steps"] == 4
    assert result["decode_tokens_per_s"] == 9 / 4 and result["ms_per_step"] == 1000.0
    with pytest.raises(RuntimeError, match="expected 5 each"):
        timing.run_cohort(FakeLLM(stop_early=1), [[1]] * 3, types.SimpleNamespace(max_tokens=5), 5)


def test_stats_dict():
    @dataclasses.dataclass
    class Stats:
        total_pages: int
        density: dict

    assert timing.stats_dict(Stats(10, {2: 0.5})) == {"total_pages": 10, "density": {"2": 0.5}}
    assert timing.stats_dict(types.SimpleNamespace(free_pages=3, _private=1)) == {"free_pages": 3}


def _rows():
    from wise_core.presets import PRESETS
    args = tp.build_parser().parse_args([])
    config = PRESETS["ouro-1.4b"]
    rows = []
    for arm, tok_s, density in (("dense", 700.0, None), ("wise", 1000.0, {"2": 0.3, "3": 0.25}), ("old", 650.0, None),
                                ("dense-default", 686.0, None), ("wise-default", 880.0, {"2": 0.3, "3": 0.25})):
        spec = dict(context=1024, batch=64, q_scale=8.0, arm=arm)
        result = dict(status="ok", repeats=[dict(decode_tokens_per_s=tok_s * f, ms_per_step=64e3 / (tok_s * f),
                                                 prefill_s=1.0, density=density, fallbacks=0, preemptions=0,
                                                 pages_returned=True) for f in (0.98, 1.02)])
        rows += [decode_report.row_of(spec, result, i, config, args) for i in range(2)]
    rows.append(decode_report.row_of(dict(context=1024, batch=64, q_scale=8.0, arm="fa4"),
                          dict(status="not importable: ModuleNotFoundError"), None, config, args))
    return args, rows


def test_summary_standing_and_report(tmp_path):
    args, rows = _rows()
    assert rows[2]["density"] == {2: 0.3, 3: 0.25}
    assert rows[2]["roofline_tokens_per_s"] > rows[0]["roofline_tokens_per_s"]  # WISE reads fewer bytes
    summary = decode_report.summarize(rows)
    by_arm = {s["arm"]: s for s in summary}
    assert by_arm["dense"]["decode_tokens_per_s"] == pytest.approx(700.0)
    assert by_arm["wise"]["over_dense"] == pytest.approx(1000 / 700)
    assert by_arm["dense"]["roofline_share"] == pytest.approx(700 / rows[0]["roofline_tokens_per_s"])
    assert by_arm["wise-default"]["over_dense"] == pytest.approx(880 / 686)    # over dense-default
    standing = {t["target"]: t for t in decode_report.standing(summary)}
    assert standing["wise / dense >= 1.30"]["met"] and standing["wise / dense >= 1.30"]["value"] == pytest.approx(1000 / 700)
    assert not standing["wise-default / dense-default >= 1.30"]["met"]            # 880 / 686 = 1.28
    share = standing["dense >= 75% of the roofline"]
    assert share["met"] == (share["value"] >= 0.75)
    assert standing["dense-default >= 0.97 x dense"]["met"]                        # 686 / 700 = 0.98
    assert not standing["wise-default >= 0.97 x wise"]["met"]                      # 880 / 1000
    one = [dict(s, batch=1) for s in summary if s["arm"] in ("dense", "wise")]   # WISE / dense >= 1 at batch 1
    assert [t["target"] for t in decode_report.standing(one)] == ["dense: batch 1 at 1K <= 4.0 ms/step", "wise / dense >= 1.00"]
    report = dict(date="today", model="random", args=vars(args) | {"out": "x"}, rows=rows, summary=summary,
                  standing=list(standing.values()), environment=None)
    text = decode_report.write_report(report, tmp_path)
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert json.loads((tmp_path / "throughput.json").read_text())["rows"][0]["arm"] == "dense"
    assert "not importable: ModuleNotFoundError" in text and "| wise / dense >= 1.30 | 1024x64 | 1.43 | yes |" in text
    assert text.count("| 1024 x 64 | 8 | wise |") == 2 and text.count("| 1024 x 64 | wise |") == 1  # repeats, mean


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git history")
def test_old_source_tree_from_git(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    args = tp.build_parser().parse_args(["--old-commit", head])
    src = Path(arms.prepare_old_src(args, tmp_path))
    assert (src / "wise_torch" / "generate.py").is_file() and (src / "wise_core" / "config.py").is_file()


def test_smoke_run_end_to_end_in_fresh_processes(tmp_path, monkeypatch):
    """Every arm on test-tiny (fp32, reference kernel): the engine's dense and WISE, FA4 (not
    importable on CPU), the pre-engine generate from the source tree given (here this one)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the workers' torch: tiny shapes, no spinning threads
    report = tp.main(["--preset", "test-tiny", "--dtype", "float32", "--device", "cpu", "--kernel", "reference",
                      "--shapes", "64x3", "--q-scale", "2", "--new-tokens", "5", "--warmup-tokens", "2",
                      "--page-size", "32", "--arms", "dense,wise,fa4,old", "--old-src", str(ROOT),
                      "--out", str(tmp_path)])
    rows = report["rows"]
    assert [(r["arm"], r["repeat"]) for r in rows] == [
        ("dense", 0), ("dense", 1), ("wise", 0), ("wise", 1), ("fa4", None), ("old", 0), ("old", 1)]
    if importlib.util.find_spec("flash_attn") is None:
        assert rows[4]["status"].startswith("not importable")
    for r in rows[:4] + rows[5:]:
        assert r["status"] == "ok" and r["q_scale"] == 2.0, r
        # 3 requests x 5 tokens; the first token of each is not timed.
        assert r["decode_tokens"] == 3 * 4 and r["decode_steps"] == 4
        assert r["decode_tokens_per_s"] > 0 and 0 < r["roofline_share"] < 1
        assert (r["density"] is None) == (r["arm"] != "wise")
    for r in rows[:4]:  # the engine arms
        assert r["pages_returned"] is True and r["preemptions"] == 0
    for r in rows[2:4]:
        assert r["fallbacks"] == 0 and r["counters"] == "this cohort"
        assert set(r["density"]) == {2, 3} and all(0 < d <= 1 for d in r["density"].values())
    assert {s["arm"] for s in report["summary"]} == {"dense", "wise", "old"}
    assert report["old_src"] == str(ROOT) and report["environment"]["device"] == "cpu"
    assert {"throughput.json", "throughput.md", "throughput.png"} <= {p.name for p in tmp_path.iterdir()}


def test_roofline_of_huginn_by_hand():
    """test-tiny-huginn (1 prelude, 3 core, 2 coda layers; hidden 128, MLP 256, 2 heads of 64, vocab
    384, tied head), float32, counted by hand."""
    from wise_core.presets import PRESETS
    tiny = PRESETS["test-tiny-huginn"]
    h, i = 128, 256
    layer = 4 * h + 3 * h * h + h * h + 2 * i * h + h * i + 2 * 2 * 64   # norms, Wqkv, proj, fc, mlp.proj, qk_bias
    once = (1 + 2) * layer + h                                            # prelude, coda, ln_f
    per_step = 3 * layer + h * 2 * h                                      # the core block, the adapter
    head = 384 * h                                                        # wte, tied
    assert timing.weight_bytes_per_step(tiny, "float32", 2, 5) == 4 * (5 * per_step + once + head + 2 * h)
    assert timing.weight_bytes_per_step(tiny, "float32", 2) == timing.weight_bytes_per_step(tiny, "float32", 2, 4)
    per_token = 2 * 2 * 64 * 4                                            # K and V, 2 heads of 64, float32
    assert timing.kv_bytes_per_step(tiny, "float32", 1, 1, None, 5) == (1 + 2 + 3 * 5) * per_token
    # Iterations 2 and 4 reuse at densities 0.5 and 0.25: 3 dense planes + 3 per iteration.
    assert timing.kv_bytes_per_step(tiny, "float32", 2, 10, {2: 0.5, 4: 0.25}, 5) == \
        (3 + 3 * (3 + 0.5 + 0.25)) * 2 * 10 * per_token
    # huginn-0125 at r = 32: 2 + 4 x 32 + 2 = 132 planes of 2 x 5280 bf16 values, ~2.8 MB a token.
    big = PRESETS["huginn-0125"]
    assert timing.kv_bytes_per_step(big, "bfloat16", 1, 1, None, 32) == 132 * 2 * 5280 * 2
    roof = timing.roofline(big, "bfloat16", 1024, 32, 32, None, 4.3, 32)
    assert roof["bytes"] == timing.weight_bytes_per_step(big, "bfloat16", 32, 32) + \
        timing.kv_bytes_per_step(big, "bfloat16", 32, 1040, None, 32)


def test_random_huginn_queries_scaled_and_nothing_else():
    """The recipe scales q's rows of attn.Wqkv and q's half of attn.qk_bias; norms are ones; each
    tensor's draw depends on its name and the seed alone."""
    import torch
    from wise_core.presets import PRESETS
    tiny = PRESETS["test-tiny-huginn"]
    recipe = workload.random_recipe(tiny)
    assert recipe["transformer.core_block.0.attn.Wqkv.weight"] == [[3 * 128, 128], "normal", 128]
    assert recipe["transformer.coda.1.attn.qk_bias"] == [[2, 1, 2, 64], "normal", 1]
    assert recipe["transformer.prelude.0.norm_3.weight"][1:] == ["ones", 0]
    assert recipe["transformer.ln_f.weight"][1:] == ["ones", 0] and recipe["transformer.adapter.weight"][2] == 0

    def draw(name, q_scale):
        return workload.random_hf_tensor(name, *recipe[name], dict(seed=0, std=0.02, q_scale=q_scale), torch.device("cpu"))

    for name in ("transformer.core_block.0.attn.Wqkv.weight", "transformer.coda.1.attn.qk_bias"):
        one, three = draw(name, 1.0), draw(name, 3.0)
        rows = recipe[name][2]
        assert torch.equal(three[:rows], one[:rows] * 3) and torch.equal(three[rows:], one[rows:])
    assert not torch.equal(draw("transformer.core_block.0.attn.Wqkv.weight", 1.0),
                           draw("transformer.core_block.1.attn.Wqkv.weight", 1.0))
    ouro = workload.random_recipe(PRESETS["test-tiny"])
    assert ouro["model.layers.0.self_attn.q_proj.weight"][2] == 128     # every row of q_proj (2 heads of 64)
    assert ouro["model.early_exit_gate.bias"][1:] == ["zeros", 0]
    assert "architecture" not in workload.config_fields(PRESETS["test-tiny"])
    assert workload.config_fields(tiny)["architecture"] == "huginn"


def test_huginn_arguments_and_report():
    from wise_core.presets import PRESETS
    parser = tp.build_parser()
    huginn, ouro = PRESETS["huginn-0125"], PRESETS["ouro-1.4b"]
    assert arms.check_depth(parser, parser.parse_args([]), huginn) == 32                 # total_ut_steps
    assert arms.check_depth(parser, parser.parse_args(["--num-steps", "8"]), huginn) == 8
    assert arms.check_depth(parser, parser.parse_args(["--num-steps", "4"]), ouro) == 4
    for args, config, ouro_only in ((["--num-steps", "8"], ouro, []), ([], huginn, ["old"]),
                                    (["--num-steps", "0"], huginn, [])):
        with pytest.raises(SystemExit):
            arms.check_depth(parser, parser.parse_args(args), config, ouro_only)
    with pytest.raises(SystemExit, match="--layers"):
        workload.prepare_model(parser.parse_args(["--preset", "huginn-0125", "--layers", "4"]))
    assert arms.wise_profile(huginn, 32, ["dense", "wise"], 0.95) == \
        "discovery on depths 0, 1, reuse on 2..31, eta 0.95, blocks of 32 tokens"
    assert arms.wise_profile(huginn, 32, ["dense"], 0.95) is None
    assert decode_report.density_text({2: 0.3, 3: 0.25}) == "2: 0.300, 3: 0.250"
    assert decode_report.density_text({d: 0.1 * (d % 3 + 1) for d in range(2, 32)}) == \
        "2..31: mean 0.200 (0.100 at 3 .. 0.300 at 2)"
    _, rows = _rows()
    summary = decode_report.summarize(rows)
    assert decode_report.standing(summary, "huginn") == [] and decode_report.engine_standing(summary, "huginn") == []
    assert decode_report.standing(summary, "ouro") == decode_report.standing(summary)


def test_huginn_smoke_in_fresh_processes(tmp_path, monkeypatch):
    """test-tiny-huginn at 3 core iterations (fp32, reference kernel): a tight arm and a default arm
    through the engine, the roofline of 3 iterations, WISE reusing iteration 2."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from wise_core.presets import PRESETS
    report = tp.main(["--preset", "test-tiny-huginn", "--num-steps", "3", "--dtype", "float32", "--device", "cpu",
                      "--kernel", "reference", "--shapes", "64x3", "--q-scale", "2", "--new-tokens", "3",
                      "--warmup-tokens", "2", "--repeats", "1", "--page-size", "32", "--arms", "dense,wise-default",
                      "--out", str(tmp_path)])
    rows = report["rows"]
    assert [(r["arm"], r["repeat"], r["status"]) for r in rows] == [("dense", 0, "ok"), ("wise-default", 0, "ok")]
    config = PRESETS["test-tiny-huginn"]
    for r in rows:
        assert r["decode_tokens"] == 3 * 2 and r["pages_returned"] is True and r["preemptions"] == 0
        roof = timing.roofline(config, "float32", 64, 3, 3, r["density"], 4.3, 3)
        assert r["roofline_tokens_per_s"] == roof["tokens_per_s"]
    assert rows[0]["density"] is None
    assert set(rows[1]["density"]) == {2} and 0 < rows[1]["density"][2] <= 1 and rows[1]["fallbacks"] == 0
    assert report["num_steps"] == 3 and report["standing"] == []
    assert report["wise_profile"] == "discovery on depths 0, 1, reuse on 2, eta 0.95, blocks of 32 tokens"
    text = (tmp_path / "throughput.md").read_text()
    assert "3 core iterations per token; WISE profile: discovery on depths 0, 1, reuse on 2" in text
    assert "this Huginn run is held to none" in text


def test_adaptive_arms_smoke_in_fresh_processes(tmp_path, monkeypatch):
    """test-tiny-huginn at 4 core iterations: the adaptive arm's engine exits tokens early (KL < 0.01
    on these random weights: a mean depth under 4), its roofline is dense's (every iteration runs),
    and it is compared with dense (tok/s over fixed, differ counted, not an error)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from wise_core.presets import PRESETS
    report = tp.main(["--preset", "test-tiny-huginn", "--num-steps", "4", "--dtype", "float32", "--device", "cpu",
                      "--kernel", "reference", "--shapes", "64x3", "--q-scale", "2", "--new-tokens", "4",
                      "--warmup-tokens", "2", "--repeats", "1", "--page-size", "32", "--arms", "dense,adaptive",
                      "--adaptive-threshold", "0.01", "--out", str(tmp_path)])
    dense, adaptive = report["rows"]
    assert [(r["arm"], r["status"]) for r in (dense, adaptive)] == [("dense", "ok"), ("adaptive", "ok")]
    assert dense["mean_depth"] is None and 1 <= adaptive["mean_depth"] < 4
    assert adaptive["roofline_tokens_per_s"] == dense["roofline_tokens_per_s"] == \
        timing.roofline(PRESETS["test-tiny-huginn"], "float32", 64, 3, 4, None, 4.3, 4)["tokens_per_s"]
    by_arm = {s["arm"]: s for s in report["summary"]}
    assert by_arm["adaptive"]["mean_depth"] == adaptive["mean_depth"] and by_arm["dense"]["over_fixed"] is None
    assert by_arm["adaptive"]["over_fixed"] == pytest.approx(adaptive["decode_tokens_per_s"]
                                                             / dense["decode_tokens_per_s"])
    assert 0 <= by_arm["adaptive"]["differ"] <= 3 and by_arm["dense"]["differ"] == 0
    text = (tmp_path / "throughput.md").read_text()
    assert "adaptive depth: KL exit threshold 0.01, min_steps 0; exited rows ride along" in text
    assert f"| 64 x 3 | adaptive | {by_arm['adaptive']['decode_tokens_per_s']:.1f} |" in text
    assert f"| {adaptive['mean_depth']:.2f} | {by_arm['adaptive']['over_fixed']:.2f} |" in text


def test_adaptive_regroup_arm_smoke_in_fresh_processes(tmp_path, monkeypatch):
    """test-tiny-huginn at 4 core iterations: the adaptive-regroup arm (eager, regrouped by depth)
    gives the adaptive arm's tokens and mean depth (rows exit: under 4), is compared with dense
    (over fixed), and the report says it runs eager."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = tp.main(["--preset", "test-tiny-huginn", "--num-steps", "4", "--dtype", "float32", "--device", "cpu",
                      "--kernel", "reference", "--shapes", "64x3", "--q-scale", "2", "--new-tokens", "4",
                      "--warmup-tokens", "2", "--repeats", "1", "--page-size", "32",
                      "--arms", "dense,adaptive,adaptive-regroup", "--adaptive-threshold", "0.01",
                      "--out", str(tmp_path)])
    dense, adaptive, regroup = report["rows"]
    assert [(r["arm"], r["status"]) for r in report["rows"]] == [("dense", "ok"), ("adaptive", "ok"),
                                                                  ("adaptive-regroup", "ok")]
    assert regroup["tokens"] == adaptive["tokens"] and regroup["mean_depth"] == adaptive["mean_depth"] < 4
    by_arm = {s["arm"]: s for s in report["summary"]}
    assert by_arm["adaptive-regroup"]["over_fixed"] == pytest.approx(regroup["decode_tokens_per_s"]
                                                                     / dense["decode_tokens_per_s"])
    text = (tmp_path / "throughput.md").read_text()
    assert "adaptive-regroup regroups by depth (only the rows still running run the later iterations), eager " \
           "(cuda_graphs=False): on a GPU its timing is not comparable with graph-captured arms'" in text
    assert f"| 64 x 3 | adaptive-regroup | {by_arm['adaptive-regroup']['decode_tokens_per_s']:.1f} |" in text


def test_adaptive_arms_arguments():
    """The adaptive arms refused on an Ouro model (it exits by early_exit_threshold); the threshold's
    default is AdaptiveDepth's; a bad threshold refused; the arms not in the default list."""
    from wise_core.adaptive_depth import AdaptiveDepth
    from wise_core.presets import PRESETS
    parser = tp.build_parser()
    args = parser.parse_args(["--arms", "dense,wise-adaptive"])
    assert arms.adaptive_threshold(args) == AdaptiveDepth().threshold == 1e-3
    assert arms.check_depth(parser, args, PRESETS["huginn-0125"], [], ["wise-adaptive"]) == 32
    with pytest.raises(SystemExit):
        arms.check_depth(parser, args, PRESETS["ouro-1.4b"], [], ["wise-adaptive"])
    with pytest.raises(SystemExit):
        tp.main(["--preset", "test-tiny", "--device", "cpu", "--arms", "adaptive", "--out", "/nonexistent"])
    for bad in ("-1", "nan", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--adaptive-threshold", bad])
    assert not set(parser.parse_args([]).arms) & set(arms.ADAPTIVE_ARMS)
    assert arms.adaptive_text(["dense", "wise"], 1e-3) is None
