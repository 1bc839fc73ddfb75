"""wise_jax over a 2-device mesh on CPU, against one device. Not collected by the suite: run by
tests/wise_jax/test_jax_sharding.py in a subprocess whose XLA_FLAGS give it two host devices
(--xla_force_host_platform_device_count=2), so the other tests keep one.

Tolerances: each device's o_proj / down_proj output is a partial sum over its heads (MLP
columns), psum'd: one more float32 rounding per sublayer than one device's GEMM, so logits and
log-probs agree within `rounding.model_bound` (fp32) and greedy tokens are equal."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import wise_jax
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_jax import serving, sharding

from cases import prompts_of

assert jax.device_count() == 2, "run with XLA_FLAGS=--xla_force_host_platform_device_count=2"

MODES = {"dense": None, "wise": WiseConfig(eta=0.5)}


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(2)


@pytest.fixture(scope="module")
def tiny():
    config = PRESETS["test-tiny-gqa"]      # 4 query heads, 2 KV heads: one KV head and its 2 query heads a device
    return config, wise_jax.from_checkpoint_tensors(config, random_tensors(config, seed=0, std=0.08))


def assert_same_run(one, two, config, keys):
    assert two.tokens == one.tokens
    for a, b in zip(one.logits, two.logits):
        diff, bound = rounding.model_difference(b, a, config, keys=keys)
        assert diff <= bound, (diff, bound)   # fp32: partial sums added by the psum
    assert two.stats.fallbacks == one.stats.fallbacks
    if one.stats.density is not None:
        # each device counts its heads' blocks; their sum is the single device's count
        assert two.stats.density == pytest.approx(one.stats.density, abs=1e-3) and 0 < two.stats.density[2] < 1


@pytest.mark.parametrize("mode", sorted(MODES))
def test_engine_on_the_mesh_gives_the_single_device_tokens(tiny, mesh, mode):
    config, params = tiny
    prompts = prompts_of([70, 3, 129, 40], config.vocab_size)
    kw = dict(wise_config=MODES[mode], page_size=32, max_num_seqs=4, max_model_len=192, num_pages=24,
              max_num_batched_tokens=64)          # the 129-token prompt prefills in chunks
    params_sp = wise_jax.SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for name, m in (("one", None), ("two", mesh)):
        llm = wise_jax.LLM(params, config, mesh=m, **kw)
        ids = [llm.add_request(p, params_sp, keep_logits=True) for p in prompts]
        seqs = [llm.sequences[i] for i in ids]
        finals = llm.run_until_done(ids)
        outs[name] = ([o.token_ids for o in finals], [np.stack(s.logits) for s in seqs], llm.stats(), llm)
    (tok1, log1, st1, _), (tok2, log2, st2, llm) = outs["one"], outs["two"]
    assert tok2 == tok1
    for a, b in zip(log1, log2):
        diff, bound = rounding.model_difference(b, a, config, keys=141)
        assert diff <= bound, (diff, bound)   # fp32: partial sums added by the psum
    assert st2.free_pages == st2.total_pages and st2.fallbacks == st1.fallbacks
    if mode == "wise":
        assert st2.density == pytest.approx(st1.density, abs=1e-3) and 0 < st2.density[2] < 1
    # Every device holds its heads: the K/V pages on kv_heads, the supports on heads, the
    # projections on their head / MLP columns; page tables replicated.
    local = [s.data.shape for s in llm.cache.k.addressable_shards]
    assert llm.cache.k.sharding.is_equivalent_to(NamedSharding(mesh, sharding.KV_SPEC), 5)
    assert local == [llm.cache.k.shape[:3] + (1, 32)] * 2
    assert llm.cache.page_table.sharding.is_fully_replicated
    layers = llm.params.params.layers                  # unstacked: one LayerParams per layer
    assert isinstance(layers, tuple) and len(layers) == tiny[0].num_hidden_layers
    for lp in layers:
        assert [s.data.shape[0] for s in lp.o_proj.addressable_shards] == [64, 64]
        assert [s.data.shape[1] for s in lp.qkv_proj.addressable_shards] == [lp.qkv_proj.shape[1] // 2] * 2
    if mode == "wise":
        assert [s.data.shape[2] for s in llm.state.support.addressable_shards] == [2, 2]


def test_fp8_cache_on_the_mesh_gives_the_single_device_tokens(tiny, mesh):
    """kv_cache_dtype="fp8" (WISE): codes and scales sharded on kv_heads, each device quantizing its
    heads' K/V (a (token, KV head) scale is one device's); the tokens of one device (the logits may
    part by a code an fp8 rounding decision moves, so only the tokens are compared)."""
    config, params = tiny
    prompts = prompts_of([70, 3, 40], config.vocab_size)
    kw = dict(wise_config=MODES["wise"], page_size=32, max_num_seqs=4, max_model_len=128, num_pages=16,
              max_num_batched_tokens=64, kv_cache_dtype="fp8")
    tokens = {}
    for name, m in (("one", None), ("two", mesh)):
        llm = wise_jax.LLM(params, config, mesh=m, **kw)
        outs = llm.generate(prompts, wise_jax.SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    assert tokens["two"] == tokens["one"]
    for x, spec in ((llm.cache.k, sharding.KV_SPEC), (llm.cache.k_scale, sharding.SCALE_SPEC)):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
    assert [s.data.shape for s in llm.cache.k_scale.addressable_shards] == [llm.cache.k_scale.shape[:3] + (1,)] * 2


def test_mesh_layout_of_the_fused_projections(tiny, mesh):
    """Device r's block of qkv_proj is q_r | k_r | v_r, of gate_up_proj gate_r | up_r."""
    config, params = tiny
    placed = sharding.shard_params(config, params, mesh).params
    d, heads, kv, inter = config.head_dim, 4, 2, config.intermediate_size
    qkv = np.asarray(params.layers.qkv_proj)
    q, k, v = qkv[..., :heads * d], qkv[..., heads * d:(heads + kv) * d], qkv[..., (heads + kv) * d:]
    gate, up = np.asarray(params.layers.gate_up_proj)[..., :inter], np.asarray(params.layers.gate_up_proj)[..., inter:]
    for r, (a, b) in enumerate(zip(sorted(placed.layers.qkv_proj.addressable_shards, key=lambda s: s.device.id),
                                   sorted(placed.layers.gate_up_proj.addressable_shards, key=lambda s: s.device.id))):
        want = np.concatenate([q[..., r * 2 * d:(r + 1) * 2 * d], k[..., r * d:(r + 1) * d],
                               v[..., r * d:(r + 1) * d]], -1)
        np.testing.assert_array_equal(np.asarray(a.data), want)
        half = inter // 2
        np.testing.assert_array_equal(np.asarray(b.data), np.concatenate(
            [gate[..., r * half:(r + 1) * half], up[..., r * half:(r + 1) * half]], -1))


@pytest.mark.parametrize("mode", ["wise"])   # WISE runs dense discovery loops too; the engine test has dense
def test_builtin_model_generate_on_the_mesh(mesh, mode):
    config, params, tokenizer = wise_jax.load_model("ouro-py-3m", with_tokenizer=True)
    prompts = ["def fib(n):", "import os\nimport sys\n" * 12, "class Stack:\n    def push(self, x):"]
    args = dict(max_new_tokens=16, eos_token_id=None, return_logits=True, tokenizer=tokenizer,
                wise_config=None if mode == "dense" else WiseConfig())
    one = wise_jax.generate(params, config, prompts, **args)
    two = wise_jax.generate(params, config, prompts, mesh=mesh, **args)
    assert_same_run(one, two, config, keys=180)
    forced = wise_jax.teacher_force(params, config, prompts[1], two.tokens[1], tokenizer=tokenizer, mesh=mesh,
                                    wise_config=args["wise_config"])
    diff, bound = rounding.model_difference(forced.logprobs[0], wise_jax.teacher_force(
        params, config, prompts[1], two.tokens[1], tokenizer=tokenizer, wise_config=args["wise_config"]).logprobs[0],
        config, keys=180)
    assert diff <= bound, (diff, bound)       # fp32 log-probs, as the logits


def test_serving_functions_take_the_mesh(tiny, mesh):
    """prefill / insert / decode_step (the pure-function API) on mesh-layout params, cache and state."""
    config, params = tiny
    wise = MODES["wise"]
    placed = sharding.shard_params(config, params, mesh)
    prompt = prompts_of([45], config.vocab_size, seed=3)[0]
    runs = []
    for m, p in ((None, params), (mesh, placed)):
        cache = sharding.create_cache(config, m, batch=2, max_pages=4, num_pages=8, page_size=32)
        state = sharding.create_state(wise, m, slots=2, layers=2, heads=4, max_blocks=4)
        logits, kv = serving.prefill(p, config, prompt, page_size=32, mesh=m)
        cache = serving.insert(cache, kv, 1)
        token, out = int(np.argmax(logits)), []
        for _ in range(4):
            step_logits, cache, state = serving.decode_step(
                p, config, cache, state, np.array([0, token], np.int32), np.array([-1, 0], np.int32),
                wise_config=wise, kernel="reference", mesh=m)
            out.append(np.asarray(step_logits[1]))
            token = int(np.argmax(out[-1]))
        runs.append(np.stack(out))
    diff, bound = rounding.model_difference(runs[1], runs[0], config, keys=49)
    assert diff <= bound, (diff, bound)       # fp32, as above
    assert np.array_equal(runs[1].argmax(-1), runs[0].argmax(-1))


def test_bad_meshes_and_layouts_are_named(tiny, mesh):
    config, params = tiny
    placed = sharding.shard_params(config, params, mesh)
    assert sharding.shard_params(config, placed, mesh) is placed      # already in this mesh's layout
    cache = sharding.create_cache(config, mesh, batch=1, max_pages=2, num_pages=2, page_size=32)
    with pytest.raises(TypeError, match="with a mesh, params must be in its layout"):
        serving.decode_step(params, config, cache, None, np.zeros(1, np.int32), np.zeros(1, np.int32), mesh=mesh)
    with pytest.raises(ValueError, match="in the layout of a 2-device mesh; pass that mesh"):
        serving.prefill(placed, config, [1, 2, 3])
    with pytest.raises(ValueError, match="the layout of a 2-device mesh, the mesh has 1 along 'tp'"):
        sharding.shard_params(config, placed, sharding.make_mesh(1))
    with pytest.raises(ValueError, match=r"does not divide the model's num_key_value_heads \(2\)"):
        sharding.local_config(config, 3)
    with pytest.raises(ValueError, match="an axis named 'tp'"):
        wise_jax.LLM(params, config, mesh=jax.make_mesh((2,), ("x",)))
    with pytest.raises(ValueError, match="a mesh of 3 devices is not possible with 2 devices"):
        sharding.make_mesh(3)
