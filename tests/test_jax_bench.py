"""benchmarks/jax_generate_bench.py --smoke runs on CPU and writes its JSON and markdown."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "jax_generate_bench.py"


def test_smoke_run_writes_results(tmp_path):
    spec = importlib.util.spec_from_file_location("jax_generate_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke", "--models", "test-tiny", "--variants", "wise-reference", "--new-tokens", "3",
                "--dtype", "float32", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "jax_generate_bench-smoke.json").read_text())
    assert {"date", "device", "jax", "python"} <= set(results["environment"])
    (run,) = results["runs"]
    assert "error" not in run, run
    assert run["new_tokens"] == 2 * 3 and run["recompiles_timed"] == 0
    assert run["fallbacks"] == 0 and set(run["density"]) == {"2", "3"}
    table = (tmp_path / "jax_generate_bench-smoke.md").read_text()
    assert "| test-tiny | wise-reference | 2 | 64 | 3 |" in table
