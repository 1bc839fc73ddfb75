"""wise_jax over a jax.sharding.Mesh on CPU: tests/mesh_cases.py in a subprocess with two host
devices (XLA_FLAGS=--xla_force_host_platform_device_count=2; this process keeps its one device),
and the mesh arithmetic that needs no second device."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from wise_core.presets import PRESETS
from wise_jax import sharding

ROOT = Path(__file__).resolve().parents[2]


def test_two_device_mesh_cases():
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "mesh_cases.py")]
    done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=1500)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    passed = re.search(r"(\d+) passed", log)
    assert passed and int(passed.group(1)) == 7 and "skipped" not in log and "failed" not in log, log[-3000:]


def test_rank_major_layout_and_local_config():
    w = jnp.arange(2 * 12, dtype=jnp.float32).reshape(2, 12)       # parts of 4, 4, 4 columns
    got = np.asarray(sharding._rank_major(w, [4, 4, 4], 2))
    cols = [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]                   # a0 b0 c0 | a1 b1 c1
    np.testing.assert_array_equal(got, np.asarray(w)[:, cols])
    local = sharding.local_config(PRESETS["ouro-1.4b"], 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (8, 8, 2816)
    with pytest.raises(ValueError, match=r"does not divide the model.s num_key_value_heads \(16\)"):
        sharding.local_config(PRESETS["ouro-1.4b"], 3)


def test_a_mesh_larger_than_the_cpu_devices_names_the_flag_that_makes_more():
    """This process has one host device: a 2-device mesh says how to get two; a bad size says no flag."""
    with pytest.raises(ValueError, match=r"a mesh of 2 devices is not possible with 1 devices; on a CPU, set "
                                         r"XLA_FLAGS=--xla_force_host_platform_device_count=2 before jax is imported"):
        sharding.make_mesh(2)
    with pytest.raises(ValueError, match=r"a mesh of 0 devices is not possible with 1 devices$"):
        sharding.make_mesh(0)
