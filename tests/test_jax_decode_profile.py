"""benchmarks/jax_decode_profile.py on CPU: the trace summary on a made-up perfetto trace (per-step
sums, groups, span, which lines count as kernels), and one arm end to end in its worker process."""

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def profile():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("jax_decode_profile", BENCHMARKS / "jax_decode_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace(tmp_path, events):
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_device_activity_sums_stream_kernels_per_step(profile, tmp_path):
    def x(pid, tid, name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    _trace(tmp_path, [x(1, 1, "PjitFunction(_step)", 0, 500),                   # host: not counted
                      x(2, 7, "nvjet_sm90_gemm", 10, 40), x(2, 7, "memcpy128", 60, 20),
                      x(2, 7, "anonymous_mosaic_gpu_kernel", 90, 100), x(2, 7, "loop_add_fusion", 200, 10),
                      x(2, 7, "nvjet_sm90_gemm", 300, 40),
                      x(2, 8, "fusion.12", 10, 400)])                           # an op line: not a kernel
    out = profile.device_activity(tmp_path, steps=2)
    assert out["busy_us"] == pytest.approx((40 + 20 + 100 + 10 + 40) / 2)
    assert out["span_us"] == pytest.approx((340 - 10) / 2)
    assert out["groups"]["gemm"] == {"calls_per_step": 1.0, "us_per_step": 40.0}
    assert out["groups"]["copy"]["us_per_step"] == 10.0 and out["groups"]["attention"]["us_per_step"] == 50.0
    assert out["groups"]["fusion"]["calls_per_step"] == 0.5
    assert list(out["kernels"])[0] == "anonymous_mosaic_gpu_kernel"
    assert out["lines"]["/device:GPU:0 | XLA Ops"] == {"events_per_step": 0.5, "busy_us": 200.0}
    with pytest.raises(FileNotFoundError):
        profile.device_activity(tmp_path / "nothing", steps=1)


def test_one_arm_end_to_end(profile, tmp_path):
    report = profile.main(["--preset", "test-tiny", "--dtype", "float32", "--kernel", "reference", "--shapes",
                           "64x2", "--arms", "wise", "--steps", "2", "--out", str(tmp_path)])
    (run,) = report["runs"]
    assert run["status"] == "ok" and run["ms_per_step"] > 0, run["status"]
    assert report["environment"].startswith("jax ")
    assert "## 64 x 2, wise" in (tmp_path / "jax_decode_profile.md").read_text()
