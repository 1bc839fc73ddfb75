"""wise_jax on a CUDA GPU (run on the H200): cuDNN prefill attention against the reference, paged
decode against the forward, the Pallas kernel inside generate against the reference, WISE
all-blocks against dense, the engine's staggered admissions with the Pallas kernel, an
Ouro-1.4B-shaped bf16 run with a 32K-token prefill, and the cache donation. Skipped without a
jax GPU backend."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_jax import kv_cache as kvc
from wise_jax import prefill_attention as pa
from wise_jax import serving

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


@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (8, 2)])
def test_cudnn_prefill_attention_matches_reference(heads, kv_heads):
    """bf16, head_dim 128, 1,000 positions (not a multiple of anything): cuDNN and the chunked
    version against the float32 reference on the same bf16 inputs, within
    `rounding.attention_bound` with bf16 probabilities into the PV product and a bf16 output,
    plus the reference's float32 bound."""
    rng = np.random.default_rng(heads)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 1000, n, 128)), jnp.bfloat16) for n in (heads, kv_heads, kv_heads))
    assert pa.resolve_implementation("auto", jnp.bfloat16, 128) == "cudnn"
    ref = np.asarray(jax.jit(pa.causal_attention_reference)(*(x.astype(jnp.float32) for x in (q, k, v))))
    scales = dict(v_max=float(jnp.abs(v.astype(jnp.float32)).max()), head_dim=128, n_keys=1000,
                  qk_max=128 ** -0.5 * float(jnp.linalg.norm(q.astype(jnp.float32), axis=-1).max()
                                             * jnp.linalg.norm(k.astype(jnp.float32), axis=-1).max()))
    bound = (rounding.attention_bound(**scales, out_dtype="bfloat16", p_dtype="bfloat16")
             + rounding.attention_bound(**scales))
    for fn in (pa.causal_attention, pa.causal_attention_chunked):
        out = np.asarray(jax.jit(fn)(q, k, v), np.float32)
        assert np.abs(out - ref).max() <= bound, fn.__name__


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
def test_paged_decode_matches_forward(gqa, kernel):
    config, params = gqa
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (3, 150)).astype(np.int32)
    lengths, prefix = np.array([150, 97, 40]), np.array([60, 1, 33])
    with jax.default_matmul_precision("highest"):                   # fp32 comparisons without TF32
        full = np.asarray(jax.jit(wise_jax.forward, static_argnums=1)(params, config, jnp.asarray(tokens)))
        cache = kvc.create(config, batch=3, max_pages=2, num_pages=6, page_size=128)
        for b in range(3):
            logits, kv = wise_jax.prefill(params, config, tokens[b, :prefix[b]], page_size=128)
            diff, bound = rounding.model_difference(logits, full[b, prefix[b] - 1], config, keys=150)
            assert diff <= bound, (diff, bound)
            cache = wise_jax.insert(cache, kv, b)
        for step in range(int((lengths - prefix).max())):
            position = prefix + step
            live = position < lengths
            fed = np.where(live, tokens[np.arange(3), np.minimum(position, 149)], 0).astype(np.int32)
            logits, cache, _ = wise_jax.decode_step(params, config, cache, None, jnp.asarray(fed),
                                                    jnp.asarray(np.where(live, np.arange(3), -1), jnp.int32),
                                                    kernel=kernel)
            diff, bound = rounding.model_difference(np.asarray(logits)[live], full[np.arange(3)[live], position[live]],
                                                    config, keys=150)
            assert diff <= bound, (step, diff, bound)


def test_engine_staggered_admissions_with_pallas(gqa, prompts):
    """Three requests through two slots with the Pallas kernel (WISE): each gets the tokens of
    the reference kernel's run alone. fp32 at highest precision."""
    config, params = gqa
    wise = WiseConfig(eta=0.5)
    with jax.default_matmul_precision("highest"):
        llm = wise_jax.LLM(params, config, wise_config=wise, page_size=64, max_num_seqs=2, max_model_len=256,
                           num_pages=8, attention_backend="pallas")
        outs = llm.generate(prompts, wise_jax.SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            alone = wise_jax.generate(params, config, [prompt], max_new_tokens=8, eos_token_id=None, page_size=64,
                                      wise_config=wise, attention_backend="reference")
            assert out.token_ids == alone.tokens[0]
    assert llm.stats().fallbacks == 0 and llm.stats().free_pages == 8


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_generate_agrees_with_reference(gqa, prompts, dtype):
    config, params = gqa
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    runs = {}
    for wise in (None, WiseConfig(eta=0.5)):
        for kernel in ("reference", "pallas"):
            with jax.default_matmul_precision("highest"):
                runs[wise, kernel] = wise_jax.generate(params, config, prompts, max_new_tokens=8, page_size=64,
                                                       wise_config=wise, attention_backend=kernel, return_logits=True)
        ref, pal = runs[wise, "reference"], runs[wise, "pallas"]
        name = jnp.dtype(dtype).name
        if dtype == jnp.float32:
            assert pal.tokens == ref.tokens
        for a, b in zip(pal.logits, ref.logits):
            n = min(len(a), len(b)) if dtype == jnp.float32 else 1   # bf16 runs may part: first token only
            diff, bound = rounding.model_difference(a[:n], b[:n], config, keys=208, dtype=name)
            assert diff <= bound, (diff, bound)
        if wise is not None:
            assert pal.stats.fallbacks == 0 and ref.stats.fallbacks == 0
            for depth in (2, 3):
                assert abs(pal.stats.density[depth] - ref.stats.density[depth]) < 0.02


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
def test_all_blocks_wise_matches_dense(gqa, prompts, kernel):
    """On the GPU the two programs may fuse differently, so logits are compared to a tolerance;
    tokens must agree."""
    config, params = gqa
    with jax.default_matmul_precision("highest"):
        dense = wise_jax.generate(params, config, prompts, max_new_tokens=8, page_size=64, attention_backend=kernel,
                                  return_logits=True)
        wise = wise_jax.generate(params, config, prompts, max_new_tokens=8, page_size=64, return_logits=True,
                                 wise_config=WiseConfig(all_blocks=True), attention_backend=kernel)
    assert wise.tokens == dense.tokens
    for a, b in zip(wise.logits, dense.logits):
        diff, bound = rounding.model_difference(a, b, config, keys=208)
        assert diff <= bound, (diff, bound)
    assert wise.stats.density == {2: 1.0, 3: 1.0} and wise.stats.fallbacks == 0


def test_ouro_shaped_bf16_generate_long_prefill_and_donated_cache():
    config = dataclasses.replace(PRESETS["ouro-1.4b"], num_hidden_layers=2)  # real widths, vocab, loops
    params = wise_jax.init_params(config, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    prompts = np.random.default_rng(2).integers(0, config.vocab_size, (4, 300)).tolist()
    dense = wise_jax.generate(params, config, prompts, max_new_tokens=4, eos_token_id=None, attention_backend="pallas",
                              return_logits=True)
    wise = wise_jax.generate(params, config, prompts, max_new_tokens=4, eos_token_id=None,
                             wise_config=WiseConfig(), attention_backend="pallas", return_logits=True)
    for out in (dense, wise):
        assert [len(t) for t in out.tokens] == [4] * 4
        assert all(np.isfinite(x).all() for x in out.logits)
    assert wise.stats.fallbacks == 0

    # A 32K-token prefill: cuDNN attention, no [seq, seq] scores (those alone would be 64 GiB here).
    seq = 32768
    logits, kv = wise_jax.prefill(params, config, np.random.default_rng(3).integers(0, config.vocab_size, seq - 5))
    assert kv.k.shape == (8, seq, 16, 128) and np.isfinite(np.asarray(logits)).all()
    tokens = jax.ShapeDtypeStruct((seq,), jnp.int32)
    compiled = serving._prefill.lower(params, tokens, jnp.int32(seq), config=config, attention="auto",
                                      unroll=1).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 4 << 30

    deep = dataclasses.replace(config, num_hidden_layers=8)                # 32 planes; compiled only
    for kernel in ("pallas", "reference"):
        cache_bytes, aliased, temporary = decode_memory(deep, rows=4, max_pages=10, page_size=128, kernel=kernel,
                                                        dtype=jnp.bfloat16)
        assert aliased >= cache_bytes, kernel                              # donated: updated in place
        assert temporary < cache_bytes / 2, kernel                        # never copied whole
