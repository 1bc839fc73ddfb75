"""The `wise` command line, run as a subprocess on CPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def wise(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "wise_core.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


@pytest.mark.parametrize("extra", [(), ("--wise", "--eta", "0.9", "--kernel", "reference")])
def test_generate_torch_on_cpu(extra):
    result = wise("generate", "--prompt", "def fib(n):", "--max-new-tokens", "3", "--device", "cpu", *extra)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def fib(n):")
    assert "[torch] prefill: 11 tokens in" in result.stderr and "decode: 2 tokens in" in result.stderr
    assert ("fallbacks 0, density loop 2:" in result.stderr) == bool(extra)


def test_generate_jax_on_cpu():
    pytest.importorskip("jax")
    if not hasattr(__import__("wise_jax"), "generate"):
        pytest.skip("wise_jax.generate is not available")
    result = wise("generate", "--backend", "jax", "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hi") and "[jax] prefill: 2 tokens in" in result.stderr


def test_errors_and_help():
    result = wise("generate", "--prompt", "x", "--model", "no-such-model")
    assert result.returncode == 1 and "unknown model 'no-such-model'" in result.stderr
    result = wise("generate", "--help")
    help_text = " ".join(result.stdout.split())
    assert result.returncode == 0 and "built-in model name: ouro-py-3m, random-tiny" in help_text
    assert "'ouro-py-3m' is a small model trained on Python source" in help_text
    assert wise().returncode == 2  # a command is required


def test_cli_module_does_not_import_a_framework():
    code = "import sys, wise_core.cli; print(sorted({'torch', 'jax'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
