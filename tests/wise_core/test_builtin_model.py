"""The packaged trained model (wise_core/models/ouro-py-3m): registered as the default, small,
trained, loadable in both frameworks, and `wise generate` continues a prompt with it.

Skipped until the model is committed: benchmarks/train/train_builtin.py writes it (run on an H200).
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wise_core import checkpoint as ckpt
from wise_core import rounding

PACKAGED = ckpt.PACKAGED_MODELS_DIR / ckpt.TRAINED_MODEL
pytestmark = pytest.mark.skipif(
    not (PACKAGED / "config.json").exists(),
    reason=f"no trained model packaged yet: {PACKAGED} is the output of benchmarks/train/train_builtin.py "
           "(trained on an H200), committed there")
ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 8_000_000


def test_registered_as_the_default_model():
    assert ckpt.DEFAULT_MODEL == ckpt.TRAINED_MODEL
    assert "random-tiny" in ckpt.BUILTIN_MODELS
    loaded = ckpt.load_checkpoint(ckpt.TRAINED_MODEL)
    assert loaded.tokenizer is not None
    assert loaded.config.vocab_size == 258 and loaded.config.total_ut_steps == 4
    assert loaded.config.max_position_embeddings >= 2048


def test_at_most_8_mb_and_bf16():
    sizes = {p.name: p.stat().st_size for p in PACKAGED.iterdir()}
    assert sum(sizes.values()) <= MAX_BYTES, sizes
    loaded = ckpt.load_checkpoint(PACKAGED)
    n_params = sum(t.size for t in loaded.tensors.values())
    assert sizes["model.safetensors"] < 2 * n_params + 100_000  # 2 bytes a weight, plus the header


def _heldout_sample(length: int, count: int) -> list[list[int]]:
    from benchmarks.quality import stdlib_corpus

    _, held = stdlib_corpus.split_files(stdlib_corpus.list_files())
    stream = stdlib_corpus.token_stream(held)
    return [context for context, _ in stdlib_corpus.sample_contexts(stream, count, length, length, 0, seed=1)]


def test_both_frameworks_load_it_agree_and_it_is_trained():
    import jax.numpy as jnp
    import torch

    import wise_jax
    import wise_torch

    model = wise_torch.load_model(ckpt.TRAINED_MODEL)
    config, params = wise_jax.load_model(ckpt.TRAINED_MODEL)
    tokens = np.array(_heldout_sample(512, 4))
    with torch.no_grad():
        torch_logits = model(torch.from_numpy(tokens)).float().numpy()
    jax_logits = np.asarray(wise_jax.forward(params, config, jnp.asarray(tokens, jnp.int32)))
    diff, bound = rounding.model_difference(jax_logits, torch_logits, config, keys=tokens.shape[1])  # fp32, two frameworks
    assert diff <= bound, (diff, bound)
    logp = torch.log_softmax(torch.from_numpy(torch_logits[:, :-1]).double(), -1)
    nll = -logp.gather(-1, torch.from_numpy(tokens[:, 1:, None])).mean().item()
    bits_per_byte = nll / math.log(2)
    assert bits_per_byte < 2.5, bits_per_byte  # a uniform guess is 8 bits a byte


def test_wise_generate_continues_a_prompt():
    prompt = "def parse_args(argv):\n    "
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "wise", "generate", "--prompt", prompt,
                             "--max-new-tokens", "48", "--wise"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(prompt)
    continuation = result.stdout[len(prompt):]
    assert len(continuation.strip()) > 0, result.stdout
    assert "density" in result.stderr
