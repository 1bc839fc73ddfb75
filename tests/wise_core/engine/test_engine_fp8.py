"""LLM(..., kv_cache_dtype="fp8") in both engines (issue 50): greedy tokens equal to the numpy
reference model over an fp8 cache (`ouro_reference.generate(..., kv_quant=True)`), dense and
all-blocks WISE, with chunked prefill and staggered arrivals, Ouro's early exit too; prefix
caching and preemption (offload / restore) keep the tokens, dense and WISE; the pool holds 3.56x
the float32 pages of this model (head_dim 32) in the same memory; JAX's Pallas kernel reads the
fp8 pages; torch's Triton kernel, Huginn and a bad kv_cache_dtype are refused. CPU, float32 model,
reference kernel; each test runs once per framework (the refusals of torch's other fast paths:
tests/wise_torch/test_torch_engine.py).

How close the engine comes to the reference: the reference runs in float64 and rounds each K/V to
float32 before quantizing it; the engine computes in float32. Both quantize by one rule, but a
value within float32 rounding of an e4m3fn rounding decision may take the neighbouring code in
one of them (1/16 of it or less), and later loops read it: their logits agree far less closely
than an unquantized engine's (`rounding.model_bound`), yet far closer than either comes to the
unquantized reference. So each test asserts the tokens, that every reference token wins by more
than twice the logits' difference (no near tie decides it), and that the engine's logits lie
within a tenth of the quantization's own effect on them."""

import dataclasses

import numpy as np
import pytest

from engine_cases import FRAMEWORKS, Framework, drained
from wise_core import ouro_reference as R
from wise_core.checkpoint import random_tensors
from wise_core.engine import EngineArgs
from wise_core.engine import args as engine_args
from wise_core.kv_quant import entry_bytes
from wise_core.model_config import ModelConfig
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_core.wise_config import WiseConfig

CONFIG = PRESETS["test-tiny-gqa"]
TENSORS = random_tensors(CONFIG, seed=5, std=0.08)
PAGE = 32
PROMPTS = [(50, 10), (70, 10), (12, 10)]    # (prompt length, new tokens); 70 > max_num_batched_tokens: chunked
WISE = WiseConfig(eta=0.5)
MODES = pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])
FAST_KERNEL = {"torch": "triton"}     # the decode kernel that does not read fp8 pages yet (JAX's Pallas does)


@pytest.fixture(scope="module", params=FRAMEWORKS)
def model(request):
    return Framework(request.param, CONFIG, tensors=TENSORS)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, CONFIG.vocab_size, n).tolist(), new) for n, new in PROMPTS]


def engine(model, **kw):
    kw = {"num_pages": 16, "page_size": PAGE, "max_num_seqs": 4, "max_model_len": 128, "attention_backend": "reference",
          "kv_cache_dtype": "fp8", **kw}
    return model.engine(**kw)


def staggered(llm, prompts) -> list:
    """Two requests at once (one prompt chunked), the third two steps later -> each request's
    (tokens, logits [new, vocab]) in prompt order."""
    seqs, final = {}, {}

    def add(i):
        prompt, new = prompts[i]
        rid = llm.add_request(prompt, SamplingParams(max_tokens=new, ignore_eos=True), keep_logits=True)
        seqs[i] = llm.sequences[rid]
        return rid

    ids = {add(1): 1, add(0): 0}
    for step in range(40):
        if step == 2:
            ids[add(2)] = 2
        for out in llm.step():
            if out.finished:
                final[ids[out.request_id]] = out.token_ids
        if not llm.has_unfinished():
            break
    return [(final[i], np.stack(seqs[i].logits)) for i in range(len(prompts))]


def assert_follows(got: list, config, tensors, prompts):
    """got: (tokens, logits) per prompt against the fp8 reference (module docstring)."""
    changed = 0
    for (tokens, logits), (prompt, new) in zip(got, prompts):
        want, _, want_logits = R.generate(config, tensors, prompt, new, kv_quant=True)
        plain, _, plain_logits = R.generate(config, tensors, prompt, new)
        assert tokens == want
        diff = np.abs(logits - want_logits).max(-1)                   # per token
        top = np.sort(want_logits, -1)
        assert np.all(top[:, -1] - top[:, -2] > 2 * diff), (top[:, -1] - top[:, -2], diff)
        assert diff.max() <= 0.1 * np.abs(want_logits - plain_logits).max(), (diff.max(), plain_logits)
        changed += plain != want
    return changed


@pytest.mark.parametrize("wise_config", [None, WiseConfig(all_blocks=True)],
                         ids=["dense", "wise-all-blocks"])
def test_tokens_equal_the_reference_over_an_fp8_cache(model, prompts, wise_config):
    """All-blocks WISE attends densely through the WISE program (discovery, reuse, selection on
    the dequantized scores)."""
    llm = engine(model, wise_config=wise_config, max_num_batched_tokens=64)
    assert model.cache(llm).quantized
    assert "fp8" in llm.stats().pool_sizing
    changed = assert_follows(staggered(llm, prompts), CONFIG, TENSORS, prompts)
    assert changed >= 1        # the quantization changes some prompt's tokens: the test can tell
    stats = drained(llm)
    assert stats.preemptions == 0 and stats.prompt_tokens == sum(n for n, _ in PROMPTS)


EXIT_CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                          total_ut_steps=4, max_position_embeddings=512, early_exit_threshold=0.6)


def test_early_exit_copies_the_exit_loops_codes(model):
    """Ouro's early exit (tests/wise_core/test_ouro_early_exit.py's model: tokens exit at loops 0,
    1 and 3): an exited token's later planes get its exit loop's codes and scales, not a second
    quantization of their values, as the reference's `held` appends."""
    tensors = random_tensors(EXIT_CONFIG, seed=4, std=0.12)
    tensors["model.early_exit_gate.weight"] = np.random.default_rng(7).normal(0, 1.0, (1, 32)).astype(np.float32)
    tensors["model.early_exit_gate.bias"] = np.array([-0.5], np.float32)
    rng = np.random.default_rng(11)
    prompts = [(rng.integers(0, 96, n).tolist(), new) for n, new in [(12, 10), (40, 6), (70, 8)]]
    llm = engine(Framework(model.name, EXIT_CONFIG, tensors=tensors), max_num_seqs=2, max_num_batched_tokens=64)
    assert_follows(staggered(llm, prompts), EXIT_CONFIG, tensors, prompts)
    assert 1 < drained(llm).mean_decode_depth < 4


def shared_prompts(n=6, common=75, seed=0):
    """n prompts: one common prefix of `common` tokens (2 full pages and part of a third), then
    each its own suffix of 5 to 30 tokens."""
    g = np.random.default_rng(seed)
    prefix = g.integers(0, CONFIG.vocab_size, common).tolist()
    return [prefix + g.integers(0, CONFIG.vocab_size, 5 + 5 * i).tolist() for i in range(n)]


def waves(llm, prompts, size=3) -> list:
    """Each prompt's 12 greedy tokens, queued in waves of `size` (the next after the one before
    finished, so its prefix is cached)."""
    out = {}
    for w in range(0, len(prompts), size):
        ids = {llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)): i
               for i, p in enumerate(prompts[w:w + size], w)}
        for o in llm.run_until_done(list(ids)):
            out[ids[o.request_id]] = o.token_ids
    return [out[i] for i in range(len(prompts))]


@MODES
def test_prefix_caching_and_preemption_keep_the_tokens(model, wise_config):
    """A small pool (preemptions offload and restore codes and scales) with prefix caching (cached
    fp8 pages read dequantized by later prompts' prefill) gives the tokens of a pool that holds
    everything, without the cache."""
    prompts = shared_prompts()
    plain = engine(model, wise_config=wise_config, num_pages=64, max_num_seqs=8, enable_prefix_caching=False,
                   max_num_batched_tokens=256)
    want = waves(plain, prompts)
    assert drained(plain).preemptions == 0
    small = engine(model, wise_config=wise_config, num_pages=7, max_num_seqs=3, max_num_batched_tokens=40)
    assert waves(small, prompts) == want
    stats = drained(small)
    assert stats.preemptions > 0 and stats.prefix_cache_hits >= 64


def test_the_pool_holds_more_tokens_in_the_same_memory(model, monkeypatch):
    """num_pages=None on a CPU fills CPU_POOL_BYTES (made 8 MiB here): an fp8 pool holds
    4 * 32 / (32 + 4) = 3.56x the float32 pages of this model (head_dim 32), in no more bytes."""
    monkeypatch.setattr(engine_args, "CPU_POOL_BYTES", 8 << 20)
    planes = CONFIG.total_ut_steps * CONFIG.num_hidden_layers
    pools = {}
    for dtype in ("auto", "fp8"):
        llm = engine(model, num_pages=None, max_num_seqs=64, max_model_len=1024, kv_cache_dtype=dtype)
        stats, cache = llm.stats(), model.cache(llm)
        per_page = 2 * planes * PAGE * CONFIG.num_key_value_heads * entry_bytes(CONFIG.head_dim, 4, dtype)
        assert stats.total_pages == (8 << 20) // per_page and stats.total_pages * per_page <= 8 << 20
        assert ("kv_cache_dtype='fp8'" in stats.pool_sizing) == (dtype == "fp8"), stats.pool_sizing
        pools[dtype] = stats.total_pages
        assert sum(x.nbytes for x in (cache.k, cache.v, cache.k_scale, cache.v_scale)
                   if x is not None) == (stats.total_pages + 1) * per_page      # and its scratch page
    assert pools["fp8"] / pools["auto"] == pytest.approx(4 * 32 / (32 + 4), rel=0.01)    # 227 / 64 pages


def test_the_pallas_kernel_decodes_fp8_pages():
    """JAX's attention_backend='pallas' reads the fp8 pool (the Pallas kernel, interpreted on a CPU; every mode
    of a WISE step with every block selected): the numpy fp8 reference's tokens."""
    model = Framework("jax", CONFIG, tensors=TENSORS)
    prompt = [(7 * i) % CONFIG.vocab_size for i in range(40)]
    llm = engine(model, attention_backend="pallas", wise_config=WiseConfig(all_blocks=True))
    assert llm.kernel == "pallas"
    out = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == R.generate(CONFIG, TENSORS, prompt, 3, kv_quant=True)[0]


def test_refusals_name_the_setting(model):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), got 'e5m2'"):
        EngineArgs(kv_cache_dtype="e5m2")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), got 'float8'"):
        engine(model, kv_cache_dtype="float8")
    fast = FAST_KERNEL.get(model.name)
    for kw in (dict(attention_backend=fast), dict(attention_backend=fast, wise_config=WiseConfig())) if fast else ():
        with pytest.raises(ValueError, match=rf"attention_backend='{fast}' does not read kv_cache_dtype='fp8'"):
            engine(model, **kw)
    llm = engine(model, attention_backend="auto")      # the reference, on every device
    tokens = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].token_ids
    assert tokens == R.generate(CONFIG, TENSORS, [1, 2, 3], 3, kv_quant=True)[0]
    huginn = PRESETS["test-tiny-huginn"]
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not implemented for Huginn models yet"):
        engine(Framework(model.name, huginn), num_pages=8, kv_cache_dtype="fp8")
    # "auto" is the default and keeps the model's dtype
    assert EngineArgs().kv_cache_dtype == "auto"
    assert dataclasses.replace(EngineArgs(), kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
