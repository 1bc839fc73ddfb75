"""The packaged trained Huginn model (wise_core/models/huginn-py-3m): registered beside the default
model, at most 8 MB in bf16, trained, loaded by name in both frameworks, which choose the same
greedy tokens (fp32)."""

import math

import numpy as np
import pytest

from huginn_cases import bound
from wise_core import checkpoint as ckpt

NAME = ckpt.TRAINED_HUGINN_MODEL
PACKAGED = ckpt.PACKAGED_MODELS_DIR / NAME
MAX_BYTES = 8_000_000
BITS_PER_BYTE_BELOW = 3.5   # trained: 2.655 on 128 held-out windows (its README); a uniform guess is 8
pytestmark = pytest.mark.skipif(not (PACKAGED / "config.json").exists(),
                                reason=f"{PACKAGED} is not packaged (benchmarks/train/train_builtin.py "
                                       "--architecture huginn writes it)")


def heldout(length: int, count: int) -> np.ndarray:
    from benchmarks.quality import stdlib_corpus

    _, held = stdlib_corpus.split_files(stdlib_corpus.list_files())
    stream = stdlib_corpus.token_stream(held)
    return np.array([c for c, _ in stdlib_corpus.sample_contexts(stream, count, length, length, 0, seed=1)])


def test_registered_beside_the_default_model():
    assert NAME in ckpt.BUILTIN_MODELS and ckpt.DEFAULT_MODEL == ckpt.TRAINED_MODEL
    loaded = ckpt.load_checkpoint(NAME)
    assert loaded.config.architecture == "huginn" and loaded.config.vocab_size == 258
    assert loaded.tokenizer is not None


def test_at_most_8_mb_and_bf16():
    sizes = {p.name: p.stat().st_size for p in PACKAGED.iterdir()}
    assert sum(sizes.values()) <= MAX_BYTES, sizes
    loaded = ckpt.load_checkpoint(PACKAGED)
    assert all(t.dtype.name == "bfloat16" for t in loaded.tensors.values())
    n_params = sum(t.size for t in loaded.tensors.values())
    assert sizes["model.safetensors"] < 2 * n_params + 100_000  # 2 bytes a weight, plus the header


def test_both_frameworks_load_it_and_choose_the_same_greedy_tokens():
    import jax.numpy as jnp
    import torch

    import wise_jax
    import wise_torch
    from wise_jax import huginn as hg

    model = wise_torch.load_model(NAME)                       # fp32
    config, params = wise_jax.load_model(NAME)
    assert isinstance(model, wise_torch.huginn.HuginnForCausalLM) and isinstance(params, hg.HuginnParams)

    prompt, new = heldout(96, 1)[0].tolist(), 12
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new):                                  # torch's greedy tokens, full forward each step
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    jax_logits = np.asarray(hg.forward(params, config, jnp.asarray([tokens[:-1]], jnp.int32)))[0]
    # JAX, fed the same tokens, chooses each generated one: by induction the same greedy sequence
    assert jax_logits[len(prompt) - 1:].argmax(-1).tolist() == tokens[len(prompt):]

    windows = heldout(256, 4)
    with torch.no_grad():
        torch_logits = model(torch.from_numpy(windows)).numpy()
    jax_logits = np.asarray(hg.forward(params, config, jnp.asarray(windows, jnp.int32)))
    # fp32 in two frameworks: the network bound over the model's depth and its 256-key reductions
    assert np.abs(jax_logits - torch_logits).max() <= bound(config, config.total_ut_steps, torch_logits, keys=256)
    logp = torch.log_softmax(torch.from_numpy(torch_logits[:, :-1]).double(), -1)
    nll = -logp.gather(-1, torch.from_numpy(windows[:, 1:, None])).mean().item()
    assert nll / math.log(2) < BITS_PER_BYTE_BELOW, nll / math.log(2)
