"""On a GPU: the training script's cuDNN attention agrees with wise_jax's attention (values and
gradients), and the smoke training run takes the cuDNN path. Run before training on an H200."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.train import train_builtin as tb
from wise_jax import train as T

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs jax on a CUDA GPU")]


def test_cudnn_attention_matches_the_model_attention():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(key, (2, 512, 4, 64), jnp.float32).astype(jnp.bfloat16) for key in keys[:3])
    weight = jax.random.normal(keys[3], (2, 512, 4, 64), jnp.float32)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v, 0, None)[0].astype(jnp.float32) * weight)

    for attend in (T.cudnn_attend, T.dense_attend):
        assert attend(q, k, v, 0, None)[0].shape == q.shape
    out_cudnn = np.asarray(T.cudnn_attend(q, k, v, 0, None)[0], np.float32)
    out_xla = np.asarray(T.dense_attend(q, k, v, 0, None)[0], np.float32)
    np.testing.assert_allclose(out_cudnn, out_xla, atol=3e-2, rtol=3e-2)  # bf16 inputs and outputs
    grads_cudnn = jax.jit(jax.grad(lambda *a: loss(T.cudnn_attend, *a), argnums=(0, 1, 2)))(q, k, v)
    grads_xla = jax.jit(jax.grad(lambda *a: loss(T.dense_attend, *a), argnums=(0, 1, 2)))(q, k, v)
    for gc, gx in zip(grads_cudnn, grads_xla):
        gc, gx = np.asarray(gc, np.float32), np.asarray(gx, np.float32)
        assert np.linalg.norm(gc - gx) <= 0.05 * np.linalg.norm(gx)  # bf16: 5% in norm


def test_smoke_training_on_the_gpu_uses_cudnn(tmp_path):
    log = tb.main(["--smoke", "--out", str(tmp_path), "--max-steps", "30", "--eval-every", "1000"])
    assert log["train"]["attention"] == "cudnn" and not log["train"]["remat"]
    assert log["steps_done"] == 30
    evals = json.loads((tmp_path / "metrics.json").read_text())["evals"]
    assert log["final"]["heldout_bpb"] < evals[0]["heldout_bpb"] - 1.0  # it learned
