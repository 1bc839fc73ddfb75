"""benchmarks/profile/step_profile.py: the categories of a made-up decode step (attention calls to their
loops, GEMM-bounded inputs and sampling, fused ops, bookkeeping), per-step sums, HLO source
lines, and one WISE arm of each framework end to end on a CPU."""

import json

import pytest

from benchmarks.profile import step_profile as sp

ROLES = ("discover", "discover", "reuse", "reuse")


def _step(layers: int = 2) -> list[sp.Kernel]:
    """One torch-like decode step of 4 loops x `layers` layers: an input copy, then per layer a
    norm, a GEMM, an attention call (split + finish), a WISE counter kernel, a GEMM; then the
    LM head's GEMM and a sampling kernel. 1 us apart, each 1 us long but GEMMs 10 us."""
    names = ["Memcpy HtoD"]
    for _ in range(4 * layers):
        names += ["_rms_norm_kernel", "nvjet_tst_gemm", "_split_kernel", "_finish_kernel", "count_fallback_kernel",
                  "nvjet_tst_gemm"]
    names += ["nvjet_lm_head_gemm", "softmax_sample_kernel"]
    return [sp.Kernel(n, ts=2.0 * i, dur=10.0 if "gemm" in n else 1.0) for i, n in enumerate(names)]


def test_categorize_puts_each_attention_call_in_its_loop():
    step = _step()
    cats = sp.categorize(step, layers=2, roles=ROLES)
    assert cats[0] == "inputs" and cats[-1] == "sampling and readback"
    attention = [(k.name, c) for k, c in zip(step, cats) if k.name in ("_split_kernel", "_finish_kernel")]
    assert len(attention) == 16   # 8 calls of two launches
    assert [c for _, c in attention] == ["attention, discovery loops"] * 8 + ["attention, reuse loops"] * 8
    assert {c for k, c in zip(step, cats) if k.name == "count_fallback_kernel"} == {"selection / support bookkeeping"}
    assert {c for k, c in zip(step, cats) if k.name == "_rms_norm_kernel"} == {"norms / RoPE / KV writes / elementwise"}
    assert {c for k, c in zip(step, cats) if "gemm" in k.name} == {"gemm"}


def test_categorize_by_source_where_kernels_are_unnamed():
    """XLA fusions are named by HLO; their source file decides, and attention without a named
    main kernel is counted per run of consecutive attention kernels."""
    src = {"a": "/x/wise_jax/attention.py:f", "w": "/x/wise_jax/wise_state.py:g", "m": "/x/wise_jax/model.py:h"}
    step = [sp.Kernel("fusion_1", 0, 1, src["m"]), sp.Kernel("dot.1", 1, 1),
            sp.Kernel("fusion_2", 2, 1, src["a"]), sp.Kernel("fusion_3", 3, 1, src["a"]),   # call 1
            sp.Kernel("fusion_4", 4, 1, src["w"]),
            sp.Kernel("fusion_5", 5, 1, src["a"]),                                             # call 2
            sp.Kernel("dot.2", 6, 1)]
    cats = sp.categorize(step, layers=1, roles=("discover", "reuse"))
    assert cats == ["norms / RoPE / KV writes / elementwise", "gemm", "attention, discovery loops",
                    "attention, discovery loops", "selection / support bookkeeping", "attention, reuse loops", "gemm"]


def test_summarize_gives_per_step_means():
    step = _step()
    n = len(step)
    two = step + [sp.Kernel(k.name, k.ts + 1000.0, k.dur) for k in step]
    out = sp.summarize(two, 2, layers=2, roles=ROLES, host_ms=0.5)
    assert out["launches"] == n
    assert out["categories"]["gemm"] == {"ms": pytest.approx((16 + 1) * 10e-3), "launches": 17}
    assert out["categories"]["attention, reuse loops"]["launches"] == 8
    busy = sum(k.dur for k in step) / 1e3
    assert out["kernel_ms"] == pytest.approx(busy) and out["host_gap_ms"] == pytest.approx(0.5 - busy)
    assert out["top_kernels"][0]["name"] == "nvjet_tst_gemm" and out["top_kernels"][0]["calls"] == 16
    with pytest.raises(ValueError, match="do not split into 2 steps"):
        sp.summarize(two[:-1], 2, layers=2, roles=ROLES, host_ms=0.5)


HLO = """HloModule jit__step

FileNames
1 "/w/wise_jax/engine.py"
2 "/w/wise_jax/wise_state.py"

FunctionNames
1 "_step"
2 "select"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=20 end_line=20 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

ENTRY %main {
  %fusion.3 = f32[2]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(_step)/x" stack_frame_id=2}
  %dot-general.1 = f32[2]{0} dot(%a, %b), metadata={op_name="jit(_step)/dot" stack_frame_id=1}
  %copy.2 = f32[2]{0} copy(%a)
}
"""


def test_hlo_sources_name_the_innermost_frame():
    assert sp.hlo_sources(HLO) == {"fusion_3": "/w/wise_jax/wise_state.py:select",
                                   "dot_general_1": "/w/wise_jax/engine.py:_step"}


def test_one_wise_arm_of_each_framework_end_to_end(tmp_path):
    report = sp.main(["--preset", "test-tiny", "--dtype", "float32", "--kernel", "reference", "--shapes", "64x2",
                      "--arms", "wise", "--steps", "2", "--out", str(tmp_path)])
    rows = report["shapes"]["64x2"]
    assert [(r["framework"], r["status"]) for r in rows] == [("torch", "ok"), ("jax", "ok")], rows
    for r in rows:
        assert r["host_ms"] > 0 and r["launches"] > 0
        assert set(r["density"]) == {"2", "3"} and all(0 < d <= 1 for d in r["density"].values())   # reuse loops
        assert sum(c["launches"] for c in r["categories"].values()) == r["launches"]
    saved = json.loads((tmp_path / "64x2" / "step_profile.json").read_text())
    assert [r["framework"] for r in saved["rows"]] == ["torch", "jax"]
    assert "| jax | wise |" in (tmp_path / "64x2" / "step_profile.md").read_text()
