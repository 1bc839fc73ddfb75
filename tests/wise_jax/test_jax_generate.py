"""wise_jax.generate: batching, WISE against dense, compilation per bucket, eos, sampling, errors,
and the stats dataclass (the fields of wise_torch's).

One model and one set of buckets for the whole module, so the compiled programs are shared."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.config_error import ConfigError
from wise_core.presets import PRESETS
from wise_core.tokenizer import byte_tokenizer
from wise_core.wise_config import WiseConfig
from wise_jax.engine import programs, sampler
from wise_jax import kv_cache as kvc
from wise_jax import wise_state as ws

CONFIG = PRESETS["test-tiny"]
NEW = 6
PAGE = 32


@pytest.fixture(scope="module")
def params():
    return wise_jax.from_checkpoint_tensors(CONFIG, random_tensors(CONFIG, seed=4, std=0.08))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, n).tolist() for n in (70, 100, 90)]       # one bucket (128), 3-4 pages


def _run(params, prompts, **kw):
    kw = {"max_new_tokens": NEW, "page_size": PAGE, "return_logits": True, **kw}
    return wise_jax.generate(params, CONFIG, prompts, **kw)


@pytest.fixture(scope="module")
def dense(params, prompts):
    return _run(params, prompts)


def test_batch_gives_each_prompt_its_tokens_alone(params, prompts, dense):
    assert [len(t) for t in dense.tokens] == [NEW] * 3
    for prompt, tokens, logits in zip(prompts, dense.tokens, dense.logits):
        alone = _run(params, [prompt])
        assert alone.tokens[0] == tokens
        diff, bound = rounding.model_difference(alone.logits[0], logits, CONFIG, keys=128)  # fp32, other batch shapes
        assert diff <= bound, (diff, bound)
        assert logits.shape == (NEW, CONFIG.vocab_size) and logits.dtype == np.float32


def test_all_blocks_wise_is_bitwise_dense(params, prompts, dense):
    wise = _run(params, prompts, wise_config=WiseConfig(all_blocks=True))
    assert wise.tokens == dense.tokens
    for a, b in zip(wise.logits, dense.logits):
        assert np.array_equal(a, b)
    assert wise.stats.fallbacks == 0 and wise.stats.density == {2: 1.0, 3: 1.0}
    assert dense.stats.fallbacks is None and dense.stats.density is None


@pytest.fixture(scope="module")
def wise(params, prompts):
    return _run(params, prompts, wise_config=WiseConfig(eta=0.5))


def test_wise_selects_sparse_support(wise, dense):
    assert wise.stats.fallbacks == 0
    density = wise.stats.density
    assert set(density) == {2, 3} and all(0 < d < 1 for d in density.values()), density
    assert [t[0] for t in wise.tokens] == [t[0] for t in dense.tokens]         # first token: prefill
    np.testing.assert_array_equal(np.stack([x[0] for x in wise.logits]), np.stack([x[0] for x in dense.logits]))


def test_pallas_kernel_in_generate_matches_reference(params, prompts, wise):
    pallas = _run(params, prompts, wise_config=WiseConfig(eta=0.5), attention_backend="pallas")  # interpreted on CPU
    assert pallas.tokens == wise.tokens
    for a, b in zip(pallas.logits, wise.logits):
        diff, bound = rounding.model_difference(a, b, CONFIG, keys=128)   # fp32, other summation order
        assert diff <= bound, (diff, bound)
    assert pallas.stats.fallbacks == 0
    assert pallas.stats.density == pytest.approx(wise.stats.density, abs=0.01)


@pytest.mark.parametrize("mode", ["dense", "wise"])
def test_stacked_and_unstacked_layers_decode_alike(params, prompts, dense, wise, mode):
    """The engine's default per-layer weights (params.unstack_layers, a Python loop over layers)
    and a subclass's layers = "stacked" (a scan over the stacked weights: a measurement's arm,
    benchmarks/engine/jax_generate_bench.py) give the same tokens, logits within fp32 rounding
    (XLA fuses straight-line code and a loop body differently)."""
    from wise_jax.params import stack_layers, unstack_layers
    unstacked = unstack_layers(params)
    assert len(unstacked.layers) == CONFIG.num_hidden_layers
    np.testing.assert_array_equal(unstacked.layers[1].o_proj, params.layers.o_proj[1])
    np.testing.assert_array_equal(stack_layers(unstacked).layers.qkv_proj, params.layers.qkv_proj)
    wise_config = None if mode == "dense" else WiseConfig(eta=0.5)
    want = dense if mode == "dense" else wise
    stacked = type("StackedLLM", (wise_jax.LLM,), {"layers": "stacked"})
    llm = stacked(unstacked, CONFIG, wise_config=wise_config, page_size=PAGE, max_num_seqs=4, max_model_len=256)
    assert not isinstance(llm.params.layers, tuple)
    outs = llm.generate(prompts, wise_jax.SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == want.tokens
    assert llm.stats().density == want.stats.density
    assert isinstance(wise_jax.LLM(params, CONFIG, page_size=PAGE, max_num_seqs=1, max_model_len=256).params.layers,
                      tuple)
    with pytest.raises(ValueError, match="layers must be"):
        type("ScanLLM", (wise_jax.LLM,), {"layers": "scan"})(params, CONFIG, page_size=PAGE, max_num_seqs=1,
                                                             max_model_len=256)
    for short in (dataclasses.replace(unstacked, layers=unstacked.layers[:-1]),      # never silently fewer layers
                  dataclasses.replace(params, layers=jax.tree.map(lambda x: x[:-1], params.layers))):
        with pytest.raises(ValueError, match=f"params hold {CONFIG.num_hidden_layers - 1} layers, the config "):
            wise_jax.generate(short, CONFIG, prompts[:1], max_new_tokens=2, page_size=PAGE)


def decode_memory(config, *, rows, max_pages, page_size, kernel, dtype):
    """(cache bytes, aliased bytes, temporary bytes) of the engine's compiled decode step."""
    params = jax.eval_shape(lambda: wise_jax.init_params(config, jax.random.PRNGKey(0), dtype=dtype))
    wise_config = WiseConfig()
    cache = jax.eval_shape(lambda: kvc.create(config, batch=1, max_pages=1, num_pages=rows * max_pages,
                                              page_size=page_size, dtype=dtype))   # the engine's storage
    state = jax.eval_shape(lambda: ws.create(wise_config, slots=rows, layers=config.num_hidden_layers,
                                             heads=config.num_attention_heads,
                                             max_blocks=max_pages * page_size // wise_config.block_size))
    row = jnp.zeros((rows,), jnp.int32)
    inputs = programs.Rows(row, row, row, row, jnp.zeros((rows, max_pages), jnp.int32))
    compiled = programs.decode.lower(
        params, cache, state, row, inputs, sampler.draw_of([None] * rows), config=config, wise_config=wise_config, kernel=kernel, unroll=1, sampling=False, keep_logits=False,
        rows=rows, width=max_pages).compile()
    memory = compiled.memory_analysis()
    cache_bytes = 2 * cache.k.dtype.itemsize * int(np.prod(cache.k.shape))
    return cache_bytes, memory.alias_size_in_bytes, memory.temp_size_in_bytes


def test_decode_step_updates_the_donated_cache_in_place():
    """The cache is aliased to the output and never copied whole: temporaries stay far below it
    (they hold one plane's gathered keys and values per loop; 32 planes here).
    fp32 only: XLA on CPU converts a bf16 scatter's whole operand to fp32 (a GPU scatters bf16
    natively; tests/wise_jax/test_jax_gpu.py checks bf16 there)."""
    config = dataclasses.replace(CONFIG, num_hidden_layers=8)
    cache_bytes, aliased, temporary = decode_memory(config, rows=4, max_pages=20, page_size=PAGE,
                                                    kernel="reference", dtype=jnp.float32)
    assert aliased >= cache_bytes and temporary < cache_bytes / 4


def test_one_compilation_per_bucket(params):
    """A prefill step's chunks are one program per bucket (rows, tokens, width: prompts of one
    page bucket share it); the first tokens and the decode step compile once per engine shape
    (rows, pages), and greedy or sampling, whatever the lengths, limits,
    eos or sampling values in it. Caches are cleared first: an earlier test in the same process may
    have compiled the same prefill shape."""
    jax.clear_caches()
    rng = np.random.default_rng(1)
    before = wise_jax.trace_counts()
    wise_jax.generate(params, CONFIG, [rng.integers(0, 256, n).tolist() for n in (130, 145, 160)],
                      max_new_tokens=5, page_size=PAGE)                  # 5 pages each; 4 decode steps
    assert _delta(before) == {"prefill_step": 1, "first_tokens": 1, "step": 1}
    before = wise_jax.trace_counts()
    wise_jax.generate(params, CONFIG, [rng.integers(0, 256, n).tolist() for n in (131, 140, 155)],
                      max_new_tokens=20, eos_token_id=3, page_size=PAGE)
    assert _delta(before) == {}
    before = wise_jax.trace_counts()                                    # sampling: the step's other variant
    wise_jax.generate(params, CONFIG, [rng.integers(0, 256, n).tolist() for n in (131, 140, 155)],
                      max_new_tokens=20, temperature=0.7, top_p=0.9, page_size=PAGE)
    assert _delta(before) == {"first_tokens": 1, "step": 1}
    before = wise_jax.trace_counts()
    wise_jax.generate(params, CONFIG, [rng.integers(0, 256, n).tolist() for n in (150, 140, 133)],
                      max_new_tokens=12, temperature=1.3, top_p=0.5, key=jax.random.PRNGKey(3), page_size=PAGE)
    assert _delta(before) == {}


def _delta(before: dict) -> dict:
    """New traces of the per-bucket programs since `before`."""
    after = wise_jax.trace_counts()
    return {k: after[k] - before.get(k, 0) for k in ("prefill_step", "write_pages", "first_tokens", "step") if after.get(k, 0) != before.get(k, 0)}


def test_stats_are_the_dataclass_of_wise_torch(dense):
    from wise_torch import GenerationStats

    assert isinstance(dense.stats, wise_jax.GenerationStats)
    names = [f.name for f in dataclasses.fields(wise_jax.GenerationStats)]
    assert names == [f.name for f in dataclasses.fields(GenerationStats)]
    assert dense.stats.new_tokens == 3 * NEW and dense.stats.prefill_tokens == 260
    assert dense.stats.decode_tokens_per_s == pytest.approx(3 * (NEW - 1) / dense.stats.decode_s)


def test_eos_stops_each_row(params, prompts, dense):
    eos = dense.tokens[0][2]
    out = _run(params, prompts, eos_token_id=eos)
    for full, stopped in zip(dense.tokens, out.tokens):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert stopped == full[:cut]
    assert len(out.tokens[0]) <= 3
    assert out.stats.new_tokens == sum(map(len, out.tokens))


def test_sampling_is_keyed_and_top_p_narrows(params, prompts, dense):
    a = _run(params, prompts, temperature=1.0, key=jax.random.PRNGKey(1))
    b = _run(params, prompts, temperature=1.0, key=jax.random.PRNGKey(1))
    c = _run(params, prompts, temperature=1.0, key=jax.random.PRNGKey(2))
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert a.tokens != dense.tokens
    nucleus_of_one = _run(params, prompts, temperature=1.0, top_p=1e-6, key=jax.random.PRNGKey(1))
    assert nucleus_of_one.tokens == dense.tokens


def test_string_prompts_and_texts(params):
    tokenizer = byte_tokenizer()
    text = "def main():\n    return sum(range(10))  # a prompt of some seventy bytes or so....."
    out = _run(params, [text], tokenizer=tokenizer)
    assert out.texts == [tokenizer.decode(out.tokens[0])]
    ids = _run(params, [tokenizer.encode(text).ids])
    assert ids.tokens == out.tokens and ids.texts is None


def test_teacher_force_takes_strings_through_the_tokenizer(params):
    tokenizer = byte_tokenizer()
    context, continuation = "def main():\n", "    return 0"
    text = wise_jax.teacher_force(params, CONFIG, context, continuation, tokenizer=tokenizer)
    ids = wise_jax.teacher_force(params, CONFIG, tokenizer.encode(context).ids, tokenizer.encode(continuation).ids)
    assert np.array_equal(text.logprobs[0], ids.logprobs[0])


def test_load_model_rejects_a_non_floating_dtype():
    with pytest.raises(ValueError, match="dtype must be a floating dtype of"):
        wise_jax.load_model("random-tiny", dtype=jnp.int8)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"prompts": []}, ValueError, "non-empty list"),
    ({"prompts": [[]]}, ValueError, r"prompts\[0\] is empty"),
    ({"prompts": [[1, 384]]}, ValueError, "outside the vocabulary"),
    ({"prompts": ["text"]}, ValueError, "needs a tokenizer"),
    ({"prompts": [[1.7, 2.2]]}, TypeError, "integer token ids"),
    ({"prompts": [["1", "2"]]}, TypeError, "integer token ids"),
    ({"prompts": [[1] * 1020]}, ValueError, "too long"),
    ({"prompts": [[True, 2]]}, TypeError, "integer token ids"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"page_size": 48}, ValueError, "multiple of the block_size"),
    ({"attention_backend": "triton"}, ValueError, "attention_backend 'triton' is not one of wise_jax's"),
    ({"wise_config": WiseConfig(reuse_depths=(2, 4))}, ConfigError, "out of range"),
])
def test_bad_requests_raise(params, kwargs, error, match):
    kwargs = {"prompts": [[1, 2, 3]], "max_new_tokens": 8, **kwargs}
    with pytest.raises(error, match=match):
        wise_jax.generate(params, CONFIG, kwargs.pop("prompts"), **kwargs)
