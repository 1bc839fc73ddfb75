"""benchmarks/profile/device_trace.py: device lines, stream kernels and per-step activity of a made-up
perfetto trace (which lines count as kernels, per-step sums, groups, span)."""

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.profile import device_trace


def write_trace(folder: Path, events: list[dict]) -> None:
    """A perfetto trace as jax.profiler writes it: a host process, a device with a stream line
    and an op line, then `events`."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    folder = folder / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def x(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


EVENTS = [x(1, 1, "PjitFunction(_step)", 0, 500),                                 # host: not a kernel
          x(2, 7, "nvjet_sm90_gemm", 10, 40), x(2, 7, "memcpy128", 60, 20),
          x(2, 7, "anonymous_mosaic_gpu_kernel", 90, 100), x(2, 7, "loop_add_fusion", 200, 10),
          x(2, 7, "nvjet_sm90_gemm", 300, 40),
          x(2, 8, "fusion.12", 10, 400)]                                          # an op line: not a kernel


def test_device_lines_and_stream_kernels(tmp_path):
    write_trace(tmp_path, EVENTS)
    lines = device_trace.device_lines(tmp_path)
    assert set(lines) == {"/device:GPU:0 | Stream #14(Compute)", "/device:GPU:0 | XLA Ops"}
    assert [e["name"] for e in device_trace.stream_kernels(lines)] == [
        "nvjet_sm90_gemm", "memcpy128", "anonymous_mosaic_gpu_kernel", "loop_add_fusion", "nvjet_sm90_gemm"]
    assert "/host:CPU | 1" in device_trace.device_lines(tmp_path, host=True)
    with pytest.raises(FileNotFoundError):
        device_trace.device_lines(tmp_path / "nothing")


def test_device_activity_sums_stream_kernels_per_step(tmp_path):
    write_trace(tmp_path, EVENTS)
    out = device_trace.device_activity(tmp_path, steps=2)
    assert out["busy_us"] == pytest.approx((40 + 20 + 100 + 10 + 40) / 2)
    assert out["span_us"] == pytest.approx((340 - 10) / 2)
    assert out["groups"]["gemm"] == {"calls_per_step": 1.0, "us_per_step": 40.0}
    assert out["groups"]["copy"]["us_per_step"] == 10.0 and out["groups"]["attention"]["us_per_step"] == 50.0
    assert out["groups"]["fusion"]["calls_per_step"] == 0.5
    assert list(out["kernels"])[0] == "anonymous_mosaic_gpu_kernel"
    assert out["lines"]["/device:GPU:0 | XLA Ops"] == {"events_per_step": 0.5, "busy_us": 200.0}
