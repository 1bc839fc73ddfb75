"""wise_jax on a CUDA GPU (run on the H200): paged decode against the forward, the Pallas kernel
inside generate against the reference, WISE all-blocks against dense, an Ouro-1.4B-shaped bf16
smoke run, and the cache donation. Skipped without a jax GPU backend."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.config import PRESETS, WiseConfig
from wise_jax import kv_cache as kvc
from wise_jax import model

from test_jax_generate import decode_memory  # tests/ is on sys.path under pytest


def _jax_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _jax_gpu(), reason="needs a CUDA GPU for jax")]


@pytest.fixture(scope="module")
def gqa():
    config = PRESETS["test-tiny-gqa"]
    return config, wise_jax.from_checkpoint_tensors(config, random_tensors(config, seed=4, std=0.08))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, n).tolist() for n in (200, 130, 77)]


@functools.partial(jax.jit, static_argnames=("config", "kernel"))
def _step(params, cache, tokens, *, config, kernel):
    batch = tokens.shape[0]
    logits, cache, _ = model.decode_step(params, config, cache, None, tokens, jnp.arange(batch),
                                         jnp.ones(batch, bool), wise_config=None, kernel=kernel)
    return logits, cache


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
def test_paged_decode_matches_forward(gqa, kernel):
    config, params = gqa
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (3, 150)).astype(np.int32)
    lengths, prefix = np.array([150, 97, 40]), np.array([60, 1, 33])
    with jax.default_matmul_precision("highest"):                   # fp32 comparisons without TF32
        full = np.asarray(jax.jit(wise_jax.forward, static_argnums=1)(params, config, jnp.asarray(tokens)))
        cache = kvc.create(config, batch=3, max_pages=2, num_pages=6, page_size=128)
        logits, cache = jax.jit(model.prefill, static_argnums=1)(params, config, cache, jnp.asarray(tokens[:, :64]),
                                                                 jnp.asarray(prefix, jnp.int32))
        diff, bound = rounding.model_difference(logits, full[np.arange(3), prefix - 1], config, keys=150)
        assert diff <= bound, (diff, bound)
        for step in range(int((lengths - prefix).max())):
            position = prefix + step
            fed = np.where(position < lengths, tokens[np.arange(3), np.minimum(position, 149)], 0)
            logits, cache = _step(params, cache, jnp.asarray(fed, jnp.int32), config=config, kernel=kernel)
            live = position < lengths
            diff, bound = rounding.model_difference(np.asarray(logits)[live], full[np.arange(3)[live], position[live]],
                                                    config, keys=150)
            assert diff <= bound, (step, diff, bound)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_generate_agrees_with_reference(gqa, prompts, dtype):
    config, params = gqa
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    runs = {}
    for wise in (None, WiseConfig(eta=0.5)):
        for kernel in ("reference", "pallas"):
            with jax.default_matmul_precision("highest"):
                runs[wise, kernel] = wise_jax.generate(params, config, prompts, max_new_tokens=8, page_size=64,
                                                       wise_config=wise, kernel=kernel, return_logits=True)
        ref, pal = runs[wise, "reference"], runs[wise, "pallas"]
        name = jnp.dtype(dtype).name
        if dtype == jnp.float32:
            assert pal.tokens == ref.tokens
        for a, b in zip(pal.logits, ref.logits):
            n = min(len(a), len(b)) if dtype == jnp.float32 else 1   # bf16 runs may part: first token only
            diff, bound = rounding.model_difference(a[:n], b[:n], config, keys=208, dtype=name)
            assert diff <= bound, (diff, bound)
        if wise is not None:
            assert pal.stats["fallbacks"] == 0 and ref.stats["fallbacks"] == 0
            for depth in (2, 3):
                assert abs(pal.stats["density"][depth] - ref.stats["density"][depth]) < 0.02


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
def test_all_blocks_wise_matches_dense(gqa, prompts, kernel):
    """On the GPU the two programs may fuse differently, so logits are compared to a tolerance;
    tokens must agree."""
    config, params = gqa
    with jax.default_matmul_precision("highest"):
        dense = wise_jax.generate(params, config, prompts, max_new_tokens=8, page_size=64, kernel=kernel,
                                  return_logits=True)
        wise = wise_jax.generate(params, config, prompts, max_new_tokens=8, page_size=64, return_logits=True,
                                 wise_config=WiseConfig(all_blocks=True, kernel=kernel))
    assert wise.tokens == dense.tokens
    for a, b in zip(wise.logits, dense.logits):
        diff, bound = rounding.model_difference(a, b, config, keys=208)
        assert diff <= bound, (diff, bound)
    assert wise.stats["density"] == {2: 1.0, 3: 1.0} and wise.stats["fallbacks"] == 0


def test_ouro_shaped_bf16_generate_and_donated_cache():
    config = dataclasses.replace(PRESETS["ouro-1.4b"], num_hidden_layers=2)  # real widths, vocab, loops
    params = wise_jax.init_params(config, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    prompts = np.random.default_rng(2).integers(0, config.vocab_size, (4, 300)).tolist()
    dense = wise_jax.generate(params, config, prompts, max_new_tokens=4, eos_token_id=None, kernel="pallas",
                              return_logits=True)
    wise = wise_jax.generate(params, config, prompts, max_new_tokens=4, eos_token_id=None,
                             wise_config=WiseConfig(kernel="pallas"), return_logits=True)
    for out in (dense, wise):
        assert [len(t) for t in out.tokens] == [4] * 4
        assert all(np.isfinite(x).all() for x in out.logits)
    assert wise.stats["fallbacks"] == 0

    deep = dataclasses.replace(config, num_hidden_layers=8)                # 32 planes; compiled only
    for kernel in ("pallas", "reference"):
        cache_bytes, aliased, temporary = decode_memory(deep, batch=4, max_pages=10, page_size=128, kernel=kernel,
                                                        dtype=jnp.bfloat16)
        assert aliased >= cache_bytes, kernel                              # donated: updated in place
        assert temporary < cache_bytes / 2, kernel                        # never copied whole
