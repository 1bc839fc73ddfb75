"""wise_jax.checks: every public entry of the functional API refuses a structure that does not
match its config -- one case per mismatch of issue 51 and its variants -- with an error naming
the argument and both sides, raised before anything is traced (no compilation here); the
layouts the model runs (stacked, unstacked, split projections, a mesh's) pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_jax import checks, model
from wise_jax import kv_cache as kvc
from wise_jax import wise_state as ws
from wise_jax.params import split_projections, unstack_layers
from wise_jax.serving import RequestKV

CONFIG = PRESETS["test-tiny"]                     # 2 layers x 4 loops, 2 heads, 2 KV heads, head_dim 64
PAGE, MAX_PAGES, ROWS = 32, 2, 2
WISE = WiseConfig()                               # block_size 32: 2 blocks a row


@pytest.fixture(scope="module")
def params():
    return wise_jax.init_params(CONFIG, jax.random.PRNGKey(0))


def cache_of(config=CONFIG, rows=ROWS, dtype=jnp.float32):
    return kvc.create(config, batch=rows, max_pages=MAX_PAGES, num_pages=4, page_size=PAGE, dtype=dtype)


def state_of(wise_config=WISE, slots=ROWS, layers=2, heads=2, max_blocks=MAX_PAGES * PAGE // 32):
    return ws.create(wise_config, slots=slots, layers=layers, heads=heads, max_blocks=max_blocks)


TOKENS, TAGS = jnp.zeros((ROWS,), jnp.int32), jnp.arange(ROWS, dtype=jnp.int32)
OTHER = {"loops": dict(total_ut_steps=2), "kv_heads": dict(num_key_value_heads=1), "head_dim": dict(head_dim=32)}

# (case, the arguments changed from a matching call, the error's message); issue 51's cases first
DECODE_CASES = [
    ("planes", dict(cache=lambda: cache_of(dataclasses.replace(CONFIG, **OTHER["loops"]))),
     r"cache holds 4 planes .*config.total_ut_steps x num_hidden_layers = 4 x 2 = 8"),
    ("kv_heads", dict(cache=lambda: cache_of(dataclasses.replace(CONFIG, **OTHER["kv_heads"]))),
     r"cache holds 1 kv_heads \(cache.k is float32\[8, 5, 32, 1, 64\]\); config.num_key_value_heads = 2"),
    ("head_dim", dict(cache=lambda: cache_of(dataclasses.replace(CONFIG, **OTHER["head_dim"]))),
     r"cache holds 32 head_dim .*config.head_dim = 64"),
    ("cache_dtype", dict(cache=lambda: cache_of(dtype=jnp.bfloat16)),
     r"cache holds bfloat16 K/V but the params compute in float32"),
    ("three_rows_of_tokens", dict(tokens=lambda: jnp.zeros((3,), jnp.int32)),
     r"tokens must be an integer array \[rows=2\] .*got int32\[3\]"),
    ("two_dim_tokens", dict(tokens=lambda: jnp.zeros((ROWS, 1), jnp.int32)),
     r"tokens must be an integer array \[rows=2\] .*got int32\[2, 1\]"),
    ("float_tokens", dict(tokens=lambda: jnp.zeros((ROWS,), jnp.float32)), r"tokens must be .*got float32\[2\]"),
    ("tags_list", dict(tags=lambda: [0, 1]), r"tags must be an integer array \[rows=2\] .*got list"),
    ("wise_without_state", dict(state=lambda: None), r"wise_config is given but state is None"),
    ("state_without_wise", dict(wise_config=None), r"a WISE state is given but wise_config is None"),
    ("state_layers", dict(state=lambda: state_of(layers=1)),
     r"state holds 1 layers \(state.support is bool\[1, 2, 2, 2\]\); config.loop_layers = 2"),
    ("state_other_block_size", dict(state=lambda: state_of(WiseConfig(block_size=16), max_blocks=4)),
     r"state was made for a WiseConfig of block_size 16, discover_depths \(0, 1\), reuse_depths \(2, 3\); "
     r"wise_config has block_size 32"),
    ("state_other_depths", dict(state=lambda: state_of(WiseConfig(discover_depths=(0,), reuse_depths=(1, 2, 3)))),
     r"state was made for .*discover_depths \(0,\), reuse_depths \(1, 2, 3\); wise_config has .*"
     r"discover_depths \(0, 1\), reuse_depths \(2, 3\)"),
    ("state_heads", dict(state=lambda: state_of(heads=4)), r"state holds 4 heads .*config.num_attention_heads = 2"),
    ("state_slots", dict(state=lambda: state_of(slots=4)), r"state holds 4 slots .*the cache's rows"),
    ("state_blocks", dict(state=lambda: state_of(max_blocks=1)),
     r"state holds supports of 1 blocks .*the step attends 2"),
    ("reuse_past_the_loops", dict(wise_config=WiseConfig(reuse_depths=(2, 7))),
     r"wise_config depths \[7\] .*out of range for config.total_ut_steps = 4 loops"),
    ("block_size_over_page", dict(wise_config=WiseConfig(block_size=64)),
     r"wise_config.block_size 64 does not divide the cache's page_size 32"),
    ("width", dict(width=3), r"width must be None or an integer in \[1, 2\]"),
    ("wise_config_type", dict(wise_config=0.95, state=lambda: None), r"wise_config must be None .* got float"),
    ("cache_type", dict(cache=lambda: {"k": 0}), r"cache must be a PagedKVCache .*got dict"),
]


def call(entry, params, *, config=CONFIG, width=None, **changed):
    args = dict(cache=cache_of, state=state_of, tokens=lambda: TOKENS, tags=lambda: TAGS, wise_config=WISE)
    args.update(changed)
    made = {k: v() if callable(v) else v for k, v in args.items()}
    return entry(params, config, made["cache"], made["state"], made["tokens"], made["tags"],
                 wise_config=made["wise_config"], kernel="reference", width=width)


@pytest.mark.parametrize("case,changed,match", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_step_refuses_a_mismatch(params, case, changed, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(wise_jax.decode_step, params, **changed)        # jitted: raised at trace, nothing compiled


def test_model_decode_step_checks_too(params):
    """The unjitted step (model.decode_step, what sharding and the engine run) checks first."""
    with pytest.raises(ValueError, match=r"state holds 1 layers"):
        call(model.decode_step, params, state=lambda: state_of(layers=1))


PARAM_CASES = [   # (case, config the params are given with, message)
    ("hidden_half", dataclasses.replace(CONFIG, hidden_size=64),
     r"params.embed_tokens is float32\[384, 128\]; the config's \[vocab_size, hidden_size\] is \[384, 64\]"),
    ("other_heads", dataclasses.replace(CONFIG, num_attention_heads=4),
     r"params.layers.qkv_proj is float32\[2, 128, 384\]; the config's \[layers, hidden_size, "
     r"\(num_attention_heads \+ 2 \* num_key_value_heads\) \* head_dim\] is \[2, 128, 512\]"),
    ("intermediate", dataclasses.replace(CONFIG, intermediate_size=128),
     r"params.layers.gate_up_proj is float32\[2, 128, 512\]; the config's .* is \[2, 128, 256\]"),
    ("vocab", dataclasses.replace(CONFIG, vocab_size=500), r"params.embed_tokens is float32\[384, 128\]"),
    ("layers", dataclasses.replace(CONFIG, num_hidden_layers=3), r"params hold 2 layers, the config 3"),
    ("tied", dataclasses.replace(CONFIG, tie_word_embeddings=True),
     r"params.lm_head is given but config.tie_word_embeddings is True"),
    ("huginn", PRESETS["test-tiny-huginn"], r"config is a huginn model's"),
]


@pytest.mark.parametrize("case,config,match", PARAM_CASES, ids=[c[0] for c in PARAM_CASES])
def test_params_that_do_not_match_the_config_are_refused_everywhere(params, case, config, match):
    ids = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=match):
        wise_jax.forward(params, config, ids)
    with pytest.raises(ValueError, match=match):
        jax.grad(lambda p: wise_jax.forward(p, config, ids).sum())(params)
    with pytest.raises(ValueError, match=match):
        wise_jax.prefill(params, config, [1, 2, 3], page_size=PAGE)
    with pytest.raises(ValueError, match=match):
        model.prefill(params, config, jnp.zeros((PAGE,), jnp.int32), jnp.int32(3))


def test_params_of_every_layout_pass(params):
    for layout in (params, unstack_layers(params), split_projections(CONFIG, params),
                   unstack_layers(split_projections(CONFIG, params))):
        checks.params(layout, CONFIG)
    short = dataclasses.replace(unstack_layers(params), layers=unstack_layers(params).layers[:1])
    with pytest.raises(ValueError, match=r"params hold 1 layers, the config 2 \(num_hidden_layers\)"):
        checks.params(short, CONFIG)
    split = split_projections(CONFIG, params)
    bad = dataclasses.replace(split, layers=dataclasses.replace(
        split.layers, qkv_proj=split.layers.qkv_proj[:2]))                       # v missing
    with pytest.raises(ValueError, match=r"params.layers.qkv_proj holds parts float32\[2, 128, 128\] \| "
                                         r"float32\[2, 128, 128\]; the config.s .* is \[2, 128, 384\]"):
        checks.params(bad, CONFIG)
    with pytest.raises(TypeError, match="params must be wise_jax Params .*got dict"):
        checks.params({"embed_tokens": params.embed_tokens}, CONFIG)
    ints = dataclasses.replace(params, norm=params.norm.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"params.norm is int32\[128\]; model weights must be floating"):
        checks.params(ints, CONFIG)


def test_mesh_params_are_checked_by_their_global_shapes(params):
    mesh = wise_jax.make_mesh(1)
    sharded = wise_jax.sharding.shard_params(CONFIG, params, mesh)
    checks.params(sharded, CONFIG)
    with pytest.raises(ValueError, match=r"params.params.embed_tokens is float32\[384, 128\]"):
        checks.params(sharded, dataclasses.replace(CONFIG, hidden_size=64))


@pytest.mark.parametrize("case,kv,match", [
    ("planes", dict(planes=4), r"the request's K/V hold 4 planes \(k is float32\[4, 32, 2, 64\]\), the cache 8"),
    ("kv_heads", dict(kv_heads=1), r"the request's K/V hold 1 kv_heads .*the cache 2"),
    ("head_dim", dict(head_dim=32), r"hold 32 head_dim .*the cache 64"),
    ("dtype", dict(dtype=jnp.bfloat16), r"the request's K/V are bfloat16, the cache float32"),
    ("part_page", dict(span=40), r"K/V of 40 positions is not a whole number of pages of 32"),
    ("too_long", dict(span=96), r"K/V of 96 positions .*within the 2 a row holds"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_insert_refuses_kv_that_do_not_fit_the_cache(case, kv, match):
    shape = dict(planes=8, span=32, kv_heads=2, head_dim=64, dtype=jnp.float32)
    shape.update(kv)
    k = jnp.zeros((shape["planes"], shape["span"], shape["kv_heads"], shape["head_dim"]), shape["dtype"])
    request = RequestKV(k, k, jnp.int32(3))
    with pytest.raises(ValueError, match=match):
        wise_jax.insert(cache_of(), request, 0)
    with pytest.raises(ValueError, match=match):
        jax.jit(kvc.insert)(cache_of(), request.k, request.v, request.length, jnp.int32(0))


@pytest.mark.parametrize("kwargs,match", [
    (dict(planes=4), r"PagedKVCache planes=4 but the config runs 4 loops x 2 layers = 8 planes"),
    (dict(dtype=jnp.int32), r"PagedKVCache dtype must be a floating dtype"),
    (dict(page_size=0), r"PagedKVCache page_size must be a positive integer, got 0"),
    (dict(batch=2.0), r"PagedKVCache batch must be a positive integer, got 2.0"),
    (dict(config=PRESETS["test-tiny-huginn"]), r"a Huginn cache takes planes = prelude \+ coda \+ steps x core"),
])
def test_cache_create_checks_its_settings(kwargs, match):
    args = dict(config=CONFIG, batch=1, max_pages=1, num_pages=1, page_size=PAGE)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kvc.create(args.pop("config"), **args)


def test_state_create_checks_its_settings_and_records_its_config():
    with pytest.raises(TypeError, match="wise_config must be a wise_core WiseConfig, got float"):
        ws.create(0.95, slots=1, layers=1, heads=1, max_blocks=1)
    with pytest.raises(ValueError, match="WiseState slots must be a positive integer, got 0"):
        ws.create(WISE, slots=0, layers=1, heads=1, max_blocks=1)
    state = ws.create(WiseConfig(block_size=16, reuse_depths=(2,)), slots=1, layers=1, heads=1, max_blocks=1)
    assert (state.block_size, state.discover_depths, state.reuse_depths) == (16, (0, 1), (2,))
    leaves, treedef = jax.tree.flatten(state)                    # static: part of the pytree's structure
    assert len(leaves) == 7 and jax.tree.unflatten(treedef, leaves).block_size == 16


def test_model_prefill_checks_its_tokens(params):
    with pytest.raises(ValueError, match=r"tokens must be a 1-D integer array \(one prompt\), got int32\[1, 32\]"):
        model.prefill(params, CONFIG, jnp.zeros((1, PAGE), jnp.int32), jnp.int32(3))
    with pytest.raises(ValueError, match=r"length must be an integer scalar, got float32\[\]"):
        model.prefill(params, CONFIG, jnp.zeros((PAGE,), jnp.int32), jnp.float32(3))


def test_a_matching_call_passes_every_check(params):
    """The checks refuse no matching structure (the decode itself is tested elsewhere): the
    check of a WISE step of the engine's shapes -- a state wider than the step's width."""
    checks.decode_step(params, CONFIG, cache_of(), state_of(max_blocks=8), TOKENS, TAGS, WISE, 1)
    checks.decode_step(unstack_layers(params), CONFIG, cache_of(), None, TOKENS, np.arange(ROWS), None, None)
