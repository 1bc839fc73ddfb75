"""wise_jax.train: resume is bitwise the uninterrupted run; the optax step follows the
hand-written AdamW step it replaced; metrics and the curve are written; data parallelism over
two (forced host) devices gives the one-device result within rounding."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wise_core.model_config import ModelConfig
from wise_jax import train as T

CONFIG = ModelConfig(
    vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
    total_ut_steps=2, early_exit_threshold=1.0, tie_word_embeddings=False, bos_token_id=256, eos_token_id=256,
    pad_token_id=257)
STREAM = np.frombuffer(b"".join(b"%d: the quick brown fox jumps over the lazy dog. " % i for i in range(100)),
                       np.uint8).astype(np.int64)  # learnable bytes
TRAIN = T.TrainConfig(batch=2, seq_len=32, max_steps=6, warmup=2, compute_dtype="float32", checkpoint_every=3,
                      accum=2)


def quiet(_):
    pass


def test_resume_is_bitwise_the_uninterrupted_run(tmp_path):
    whole, steps, _ = T.train_loop(CONFIG, TRAIN, STREAM, log=quiet)
    T.train_loop(CONFIG, TRAIN, STREAM, checkpoint_dir=tmp_path, stop_at=4, log=quiet)  # interrupted at 4
    resumed, resumed_steps, _ = T.train_loop(CONFIG, TRAIN, STREAM, checkpoint_dir=tmp_path, log=quiet)
    assert int(resumed.step) == 6 and int(resumed.position) == 6 * 2 * 2
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert [s["loss"] for s in resumed_steps] == [s["loss"] for s in steps]


# -- the hand-written AdamW step that wise_jax.train replaced (benchmarks/train/train_builtin.py) --------
def handwritten_adamw(params, grads, mu, nu, count, lr, *, weight_decay, clip, b1=0.9, b2=0.95, eps=1e-8):
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale, grads)
    count = count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
    c1, c2 = 1 - b1 ** count, 1 - b2 ** count

    def update(p, m, v, decay):
        return p - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + (weight_decay * p if decay else 0.0))

    return jax.tree.map(update, params, mu, nu, T.decays(params)), mu, nu, count


def test_optax_step_follows_the_handwritten_step():
    train = dataclasses.replace(TRAIN, accum=1, max_steps=50, warmup=10, clip=0.5)
    n = len(STREAM)
    step = T.make_train_step(CONFIG, train, n, T.mesh())
    state = T.init_state(CONFIG, train)
    params, key = state.params, state.key
    mu, nu, count = jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params), jnp.int32(0)
    stream = jnp.asarray(STREAM.astype(np.uint16))

    @jax.jit
    def reference(params, mu, nu, count, position, lr):
        tokens = T.windows(stream, T.window_offsets(train, key, position, n), train.seq_len + 1)

        def loss(params):
            ce, p = T.loop_losses(params, CONFIG, tokens)
            return T.objective(train, ce, p)

        value, grads = jax.value_and_grad(loss)(params)
        return value, *handwritten_adamw(params, grads, mu, nu, count, lr, weight_decay=train.weight_decay,
                                         clip=train.clip)

    ours, theirs, clipped = [], [], 0
    for s in range(train.max_steps):
        lr = jnp.float32(T.learning_rate(train, s, s / train.max_steps))
        value, params, mu, nu, count = reference(params, mu, nu, count, jnp.int32(s * train.batch), lr)
        state, metrics = step(state, stream, lr)
        ours.append(float(metrics["loss"]))
        theirs.append(float(value))
        clipped += float(metrics["grad_norm"]) > train.clip
    assert clipped > 10  # the clip is exercised (its 1e-6 guard is the one difference of the two steps)
    # Basis: both compute float32 losses from weights that differ only by rounding: optax orders
    # (1 - b2) * g**2 and the clip scale (max_norm / norm, without the 1e-6 guard) differently.
    # Adam normalises each update by its own second moment, so these errors do not compound:
    # measured 1.2e-7 relative over the 50 steps (2 float32 ulps); 1e-6 is 16 ulps.
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert ours[0] == theirs[0]  # the same weights and tokens: the first loss is bitwise the same
    assert ours[-1] < ours[0] - 0.1  # and it trains


def test_metrics_json_and_curve(tmp_path):
    train = dataclasses.replace(TRAIN, max_steps=3, peak_flops=1e12, checkpoint_every=0,
                                eval_every_s=1e9)   # evaluations at the start and the end only, however slow the steps
    state, steps, evals = T.train_loop(CONFIG, train, STREAM, STREAM[:800], log=quiet)
    T.write_metrics(tmp_path, steps, evals)
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert [s["step"] for s in data["steps"]] == [0, 1, 2]
    for s in data["steps"]:
        assert len(s["ce_per_loop"]) == len(s["bits_per_byte"]) == CONFIG.total_ut_steps
        assert math.isclose(s["bits_per_byte"][-1], s["ce_per_loop"][-1] / math.log(2), rel_tol=1e-5)  # all bytes
        assert s["tokens_per_s"] > 0 and 0 < s["mfu"] < 1
    assert [e["step"] for e in data["evals"]] == [0, 3] and data["evals"][-1]["heldout_bytes"] == 24 * 32
    assert (tmp_path / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="outside"):
        T.train_loop(CONFIG, TRAIN, np.full(500, 300), log=quiet)
    with pytest.raises(ValueError, match="shorter than one window"):
        T.train_loop(CONFIG, TRAIN, STREAM[:10], log=quiet)
    with pytest.raises(ValueError, match="horizon"):
        T.TrainConfig()
    with pytest.raises(ValueError, match="objective"):
        T.TrainConfig(max_steps=1, objective="mean")


DATA_PARALLEL = """
import dataclasses, sys, numpy as np, jax
sys.path.insert(0, {tests!r})
from test_jax_train import CONFIG, STREAM, TRAIN, quiet
from wise_jax import train as T
assert len(jax.devices()) == 2
state, _, _ = T.train_loop(CONFIG, dataclasses.replace(TRAIN, checkpoint_every=0, max_steps=3), STREAM, log=quiet)
np.save(sys.argv[1], np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.params)]))
"""


def test_data_parallel_two_devices_matches_one(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = tmp_path / "two.npy"
    code = DATA_PARALLEL.format(tests=str(Path(__file__).resolve().parent))
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, timeout=300)
    state, _, _ = T.train_loop(CONFIG, dataclasses.replace(TRAIN, checkpoint_every=0, max_steps=3), STREAM, log=quiet)
    one = np.concatenate([np.ravel(x) for x in jax.tree.leaves(state.params)])
    # Basis: the two devices sum the batch's gradients in another order (an all-reduce of two
    # halves): float32 reassociation, ~1e-7 relative per step, through 3 Adam steps of lr <= 2e-3.
    np.testing.assert_allclose(np.load(out), one, rtol=0, atol=1e-5)


def test_wise_train_command(tmp_path):
    from wise import cli
    from wise_core.checkpoint import load_checkpoint

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_bytes(STREAM.astype(np.uint8).tobytes())
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_dict()))
    out = tmp_path / "out"
    argv = ["train", "--data", str(tmp_path / "text"), "--out", str(out), "--model-config", str(tmp_path / "config.json"),
            "--batch", "2", "--seq-len", "32", "--max-steps", "2", "--warmup", "1", "--eval-windows", "4",
            "--final-eval-windows", "4", "--compute-dtype", "float32"]
    assert cli.main(argv) == 0
    summary = json.loads((out / "metrics.json").read_text())["summary"]
    assert summary["steps_done"] == 2 and summary["final"]["heldout_bytes"] == 4 * 32
    assert load_checkpoint(out).config == CONFIG
    assert cli.main(argv) == 0  # a second call resumes at the horizon: no step more
    assert json.loads((out / "metrics.json").read_text())["summary"]["steps_done"] == 2


def test_metrics_without_matplotlib_skip_the_plot_with_a_note(tmp_path, monkeypatch):
    """`wise train` must not fail at the end of a run for want of matplotlib (only the test extra
    installs it): metrics.json is written, the plot skipped with a note naming the package."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import matplotlib -> ImportError
    notes = []
    steps = [{"step": 0, "bits_per_byte": [3.0, 2.5]}]
    T.write_metrics(tmp_path, steps, [], {"summary": {"steps_done": 1}}, log=notes.append)
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == steps
    assert not (tmp_path / "loss_curve.png").exists()
    assert notes == [f"{tmp_path / 'loss_curve.png'} not drawn: matplotlib is not installed (pip install matplotlib); "
                     f"{tmp_path / 'metrics.json'} holds the curves"]
