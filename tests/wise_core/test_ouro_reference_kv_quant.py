"""wise_core.ouro_reference over an fp8 K/V cache (`OuroCache(kv_quant=True)`, `generate(...,
kv_quant=True)`): every appended K/V is held as `wise_core.kv_quant` gives it back, K/V copied
from the cache (an exited token's later planes) are held as they are, and kv_quant off is the
unquantized model. The engines' comparison with it: tests/wise_core/engine/test_engine_fp8.py."""

import numpy as np

from wise_core import kv_quant as K
from wise_core import ouro_reference as R
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS

CONFIG = PRESETS["test-tiny-gqa"]


def test_appends_hold_the_fp8_round_trip():
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 5, 2, 32)) * np.array([1e-3, 1e2])[:, None, None, None]
    want = K.dequantize(*K.quantize(k.astype(np.float32)), np.float32).astype(np.float64)
    assert np.array_equal(R.fp8_round_trip(k), want) and not np.array_equal(want, k)
    cache = R.OuroCache(kv_quant=True)
    cache.append(0, k[:3], v[:3])
    cache.append(0, k[3:], v[3:])
    assert np.array_equal(cache.planes[0][0], want) and np.array_equal(cache.planes[0][1], R.fp8_round_trip(v))
    held = cache.planes[0][0][-1:]
    cache.append(1, held, held, held=True)          # a copy: not quantized a second time
    assert np.array_equal(cache.planes[1][0], held)
    plain = R.OuroCache()
    plain.append(0, k, v)
    assert np.array_equal(plain.planes[0][0], k) and cache.length == plain.length == 5


def test_generate_over_an_fp8_cache():
    tensors = random_tensors(CONFIG, seed=5, std=0.08)
    prompt = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 12).tolist()
    tokens, depths, logits = R.generate(CONFIG, tensors, prompt, 4, kv_quant=True)
    plain = R.generate(CONFIG, tensors, prompt, 4)
    again = R.generate(CONFIG, tensors, prompt, 4, kv_quant=False)
    assert plain[0] == again[0] and np.array_equal(plain[2], again[2])
    assert len(tokens) == 4 and depths == [3] * 4
    # the quantization moves the logits, by far more than float64 rounding and far less than they spread
    moved = np.abs(logits - plain[2]).max()
    assert 1e-4 < moved < 0.1 * np.ptp(plain[2])
