"""wise_jax.evaluation: the quality benchmark's text run (backend jax) reports, for eta 0.95,
the numbers the helper gives; a WiseConfig equal to one already run -- a new object, a Custom
rule of the same function -- compiles nothing; README's research loop (a context rule
evaluated, a gradient) runs; the held-out pairs are cut as documented. A 1-layer variant of
test-tiny keeps the compiles short, and the tests share shapes, so compiled programs."""

import argparse
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from benchmarks.quality import evaluate as quality
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.selection import Custom
from wise_core.wise_config import WiseConfig
from wise_jax import evaluation, scoring

CONFIG = dataclasses.replace(PRESETS["test-tiny"], num_hidden_layers=1)
GREEDY, BATCH = 4, 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def params():
    return wise_jax.from_checkpoint_tensors(CONFIG, random_tensors(CONFIG, seed=5, std=0.08))


@pytest.fixture(scope="module")
def pairs():
    """4 contexts of 90-120 tokens (3-4 blocks of 32 in one page of 128), 8 forced tokens each."""
    stream = np.random.default_rng(11).integers(0, CONFIG.vocab_size, 600)
    contexts, continuations = evaluation.heldout_pairs(stream, context=120, continuation=8, count=BATCH)
    return [c[n:] for c, n in zip(contexts, (0, 10, 20, 30))], continuations


def traces() -> int:
    return scoring.TRACES["score"] + scoring.TRACES["greedy"]


def test_eta_095_equals_the_quality_benchmark(params, pairs, monkeypatch):
    contexts, continuations = pairs
    backend = quality.Backend.__new__(quality.Backend)      # the jax backend over these params
    backend.name, backend.params, backend.config, backend.tokenizer = "jax", params, CONFIG, None
    backend.kernel = "reference"                            # --kernel: its decode kernel
    monkeypatch.setattr(quality, "heldout_contexts", lambda backend, args: list(zip(contexts, continuations)))
    args = argparse.Namespace(etas=[0.95], kernel="reference", greedy=GREEDY, batch=BATCH, seed=0, quiet=True,
                              continuation=8)
    row = quality.run_text(backend, args)["rows"][0]

    compiled = traces()
    dense = evaluation.evaluate(params, CONFIG, None, contexts, continuations, greedy_tokens=GREEDY, batch=BATCH)
    arm = evaluation.evaluate(params, CONFIG, WiseConfig(eta=0.95), contexts, continuations,
                              greedy_tokens=GREEDY, batch=BATCH, dense=dense)
    assert traces() == compiled                                   # equal configs: the benchmark's programs
    assert row["per_context"]["nll"] == arm.nll.tolist()
    assert row["nll_diff"] == arm.nll_diff
    assert row["per_context"]["prefix_agreement"] == arm.prefix_agreement.tolist()
    assert row["density"] == {str(d): v for d, v in arm.density.items()} and row["fallbacks"] == arm.fallbacks == 0
    assert 0 < arm.density[2] <= 1 and arm.bits_per_byte["low"] <= arm.bits_per_byte["mean"] <= arm.bits_per_byte["high"]
    # random weights: about log2(384) = 8.6 bits a token (one byte each without a tokenizer)
    assert 7 < dense.bits_per_byte["mean"] < 11


def readme_research_loop() -> str:
    """The python block of README.md that defines top2_and_newest (the JAX research loop)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    [block] = [b for b in blocks if "def top2_and_newest" in b]
    return block


def test_the_readme_research_loop_runs_and_an_equal_rule_compiles_nothing(params, pairs, monkeypatch):
    """README's loop, on this module's 1-layer model (wise_jax.load_model patched) and so at the
    shapes of the benchmark test's dense arm: a context rule evaluated against dense, a gradient
    through the model. The same rule made again compiles nothing."""
    monkeypatch.setattr(wise_jax, "load_model", lambda name: (CONFIG, params))
    namespace = {}
    exec(compile(readme_research_loop(), "README.md", "exec"), namespace)
    arm, grads = namespace["arm"], namespace["grads"]
    assert arm.label == "top2+newest" and 0 < arm.density[2] < 1 and 0 <= arm.tokens_changed <= 1
    assert arm.bits_per_byte["low"] <= arm.bits_per_byte["mean"] <= arm.bits_per_byte["high"]
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads.layers.qkv_proj).max()) > 0
    compiled = traces()
    again = evaluation.evaluate(params, CONFIG, WiseConfig(block_size=16, selection=Custom(
        namespace["top2_and_newest"], "top2+newest", context=True)), namespace["contexts"], namespace["continuations"],
        greedy_tokens=4)
    assert traces() == compiled and again.nll.tolist() == arm.nll.tolist()


def test_heldout_pairs_and_bad_arguments(params):
    contexts, continuations = evaluation.heldout_pairs(np.arange(100), context=10, continuation=5, count=3)
    assert contexts == [list(range(0, 10)), list(range(42, 52)), list(range(85, 95))]
    assert continuations == [list(range(10, 15)), list(range(52, 57)), list(range(95, 100))]
    with pytest.raises(ValueError, match="at least context \\+ continuation = 15 tokens"):
        evaluation.heldout_pairs(np.arange(10), context=10, continuation=5, count=1)
    with pytest.raises(ValueError, match="2 contexts but 1 continuations"):
        evaluation.evaluate(params, CONFIG, None, [[1], [2]], [[3]])
    with pytest.raises(ValueError, match=r"contexts\[0\] is a string: pass tokenizer="):
        evaluation.evaluate(params, CONFIG, None, ["def"], [[3]])
