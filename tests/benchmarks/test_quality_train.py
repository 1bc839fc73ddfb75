"""The built-in model's training script (CPU, tiny shapes) and the quality harness end to end."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from benchmarks.quality import qa_scoring, evaluate as quality
from benchmarks.train import train_builtin as tb
from wise_core.checkpoint import load_checkpoint
from wise_core.model_config import ModelConfig
from wise_core.train_config import TrainConfig
from wise_jax import train as T

TINY = ModelConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0,
                   max_position_embeddings=256, total_ut_steps=3, bos_token_id=256, eos_token_id=256)


def test_loop_losses_match_the_model_forward():
    params = wise_jax.init_params(TINY, jax.random.PRNGKey(1), std=0.2)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 17), 0, 258)
    ce, p = T.loop_losses(params, TINY, tokens)
    logits, exits = wise_jax.forward_with_exits(params, TINY, tokens[:, :-1])
    expected = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    assert ce.shape == p.shape == (3, 2, 16)
    np.testing.assert_allclose(ce[-1], expected, rtol=1e-5, atol=1e-5)  # float32, same ops
    np.testing.assert_allclose(p, exits, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(p.sum(0), 1.0, rtol=1e-6)


def test_ouro_objective_on_hand_made_values():
    ce = jnp.array([[[2.0]], [[1.0]]])        # loops 2, batch 1, seq 1
    p = jnp.array([[[0.25]], [[0.75]]])
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert float(T.ouro_objective(ce, p, 0.1)) == pytest.approx(0.25 * 2 + 0.75 * 1 - 0.1 * entropy, rel=1e-6)
    one_hot = jnp.array([[[0.0]], [[1.0]]])  # xlogy keeps p = 0 finite
    assert float(T.ouro_objective(ce, one_hot, 0.1)) == pytest.approx(1.0)


def test_learning_rate_schedule():
    train = TrainConfig(lr=1.0, warmup=10, final_lr_ratio=0.1, max_steps=1)
    lr = lambda step, progress: T.learning_rate(train, step, progress)  # noqa: E731
    assert lr(0, 0.0) == pytest.approx(0.1)           # warmup: (step + 1) / warmup
    assert lr(9, 0.0) == pytest.approx(1.0)
    assert lr(100, 0.5) == pytest.approx(0.55)        # cosine midpoint between 1 and 0.1
    assert lr(100, 1.0) == pytest.approx(0.1) == lr(100, 3.0)


def test_weight_decay_skips_norms_and_biases():
    flags = T.decays(wise_jax.abstract_params(TINY))
    assert flags.layers.qkv_proj and flags.embed_tokens and flags.lm_head
    assert not flags.layers.input_layernorm and not flags.norm and not flags.early_exit_gate_bias


def test_train_step_reduces_loss_on_a_repeated_batch():
    text = np.frombuffer(b"def add(a, b):\n    return a + b\n" * 8, np.uint8)
    train = TrainConfig(batch=2, seq_len=32, weight_decay=0.0, max_steps=8)
    step = T.make_train_step(TINY, train, len(text), T.mesh())
    state, stream = T.init_state(TINY, train), jnp.asarray(text.astype(np.uint16))
    losses = []
    for _ in range(8):
        state, metrics = step(state, stream, jnp.float32(1e-2))
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 8
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.fixture(scope="module")
def smoke_model(tmp_path_factory):
    """A smoke-trained model; its run first tries cuDNN attention, which fails here (no GPU)."""
    out = tmp_path_factory.mktemp("smoke-model")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tb, "candidates", lambda batch: [("cudnn", False, batch), ("xla", False, batch)])
        # --minutes: a budget the 4 steps never reach, so a loaded machine still runs all 4
        log = tb.main(["--smoke", "--out", str(out), "--max-steps", "4", "--minutes", "5", "--eval-every", "1000"])
    return out, log


def test_smoke_training_writes_a_loadable_checkpoint(smoke_model):
    out, log = smoke_model
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json", "metrics.json",
                                                "train_log.json", "loss_curve.png", "README.md", "checkpoints"}
    assert "Held-out bits per byte (last loop)" in (out / "README.md").read_text()
    checkpoint = load_checkpoint(out)
    assert checkpoint.config == tb.SMOKE_MODEL
    saved = json.loads((out / "train_log.json").read_text())
    assert saved["train"]["attention"] == "xla"  # the fallback after cuDNN failed
    assert saved["steps_done"] == 4 and saved["tokens_seen"] == 4 * 4 * 256
    evals = json.loads((out / "metrics.json").read_text())["evals"]
    assert evals[-1]["step"] == 4 and 0 < saved["final"]["heldout_bpb"] < 9
    assert saved["versions"]["jax"] == jax.__version__
    for name, tensor in checkpoint.tensors.items():  # stored as bf16: the low 16 bits of each float32 are 0
        assert not np.any(np.asarray(tensor, np.float32).view(np.uint32) & 0xFFFF), name


def test_quality_smoke_run_on_the_smoke_model(smoke_model, tmp_path):
    out, _ = smoke_model
    result = quality.main(["text", "--smoke", "--model", str(out), "--out", str(tmp_path), "--quiet"])
    stem = tmp_path / f"quality_text_{out.name}"
    assert stem.with_suffix(".json").exists() and stem.with_suffix(".md").exists()
    assert stem.with_suffix(".png").exists()
    assert [row["eta"] for row in result["rows"]] == [0.5, 0.95]
    for row in result["rows"]:
        assert 0 < row["density"]["2"] <= 1 and 0 < row["density"]["3"] <= 1
        assert 0 <= row["greedy_prefix_agreement"]["mean"] <= 1
        assert len(row["per_context"]["nll"]) == 4
    # A lower eta keeps fewer blocks.
    assert result["rows"][0]["density"]["2"] <= result["rows"][1]["density"]["2"]


def test_qa_run_scores_the_answers(smoke_model, tmp_path):
    out, _ = smoke_model
    records = [{"question": "Which keyword defines a function?", "context": "In Python, def defines a function.",
                "answer": "def"},
               {"question": "What ends a function?", "context": [["Python", ["A return statement", " ends it."]]],
                "answers": ["return", "a return statement"]},
               {"question": "Too long?", "context": "x" * 5000, "answer": "yes"}]
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    argv = ["qa", "--model", str(out), "--data", str(data), "--max-new-tokens", "4", "--etas", "0.5",
            "--out", str(tmp_path), "--quiet"]
    with pytest.raises(SystemExit, match="example 2: prompt of .* exceeds max_position_embeddings 4096"):
        quality.main(argv)
    result = quality.main(argv + ["--skip-too-long"])
    assert result["examples"] == 2 and result["skipped_too_long"] == [2]
    golds = [["def"], ["return", "a return statement"]]
    for key, summary in (("dense", result["dense"]), ("0.5", result["rows"][0])):
        assert len(result["answers"][key]) == 2
        scores = [qa_scoring.best_scores(answer, g) for answer, g in zip(result["answers"][key], golds)]
        assert summary["em"] == pytest.approx(np.mean([s[0] for s in scores]))
        assert summary["f1"] == pytest.approx(np.mean([s[1] for s in scores]))
    assert (tmp_path / f"quality_qa_{out.name}_qa.md").exists()
