"""wise_jax.checks: every public entry of the functional API refuses a structure that does not
match its config -- one case per mismatch of issue 51 and its variants -- with an error naming
the argument and both sides, raised before anything is traced (no compilation here); the
layouts the model runs (stacked, unstacked, split projections, a mesh's) pass. The same for
wise_jax.huginn's entry points (params, cache planes for num_steps, tokens, states, WISE state)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.checkpoint import random_tensors
from wise_core.config_error import ConfigError
from wise_core.huginn_reference import num_planes
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_jax import checks, model
from wise_jax import huginn as hg
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


FORWARD_CASES = [   # (case, forward's keyword arguments, message); input_ids int32[2, 4]
    ("positions_shape", dict(positions=jnp.zeros((1, 4), jnp.int32)),
     r"positions must be None or an integer array \[batch, seq\] = \[2, 4\] \(input_ids' shape\), got int32\[1, 4\]"),
    ("positions_one_dim", dict(positions=jnp.arange(4, dtype=jnp.int32)),
     r"positions must be .*got int32\[4\]"),
    ("positions_float", dict(positions=jnp.zeros((2, 4), jnp.float32)), r"positions must be .*got float32\[2, 4\]"),
    ("positions_list", dict(positions=[[0, 1, 2, 3]] * 2), r"positions must be .*got list"),
    ("segment_ids_shape", dict(segment_ids=jnp.zeros((2, 5), jnp.int32)),
     r"segment_ids must be None or an integer array \[batch, seq\] = \[2, 4\] .*got int32\[2, 5\]"),
    ("segment_ids_bool", dict(segment_ids=jnp.zeros((2, 4), bool)), r"segment_ids must be .*got bool\[2, 4\]"),
    ("return_hidden", dict(return_hidden="yes"), r"return_hidden must be a bool .*got str"),
]


@pytest.mark.parametrize("case,kwargs,match", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_refuses_positions_and_segments_that_do_not_match_the_tokens(params, case, kwargs, match):
    """Eagerly and under jit (the array arguments traced: raised at trace, from their shapes)."""
    ids = jnp.zeros((2, 4), jnp.int32)
    error = TypeError if case == "return_hidden" else ValueError
    for entry in (wise_jax.forward, wise_jax.forward_with_exits):
        with pytest.raises(error, match=match):
            entry(params, CONFIG, ids, **kwargs)
    (name, value), = kwargs.items()
    if isinstance(value, jax.Array):
        with pytest.raises(error, match=match):
            jax.jit(lambda p, x: wise_jax.forward(p, CONFIG, ids, **{name: x}))(params, value)


# -- Huginn: wise_jax.huginn's entry points -----------------------------------------------------------
HUGINN = PRESETS["test-tiny-huginn"]              # prelude 1, core 3, coda 2 layers; 2 heads of 64; tied; qk_bias
STEPS = 2
HUGINN_PLANES = num_planes(HUGINN, STEPS)         # 1 + 2 + 2 x 3 = 9
WISE_2 = WiseConfig(reuse_depths=())              # discovery on both core iterations


@pytest.fixture(scope="module")
def huginn_params():
    return hg.huginn_from_tensors(HUGINN, random_tensors(HUGINN, seed=0))


def huginn_cache(planes=HUGINN_PLANES, dtype=jnp.float32, **replaced):
    cache = kvc.create(HUGINN, batch=ROWS, max_pages=MAX_PAGES, num_pages=4, page_size=PAGE, dtype=dtype,
                       planes=planes)
    return dataclasses.replace(cache, **replaced) if replaced else cache


def huginn_state(wise_config=WISE_2, **kw):
    args = dict(slots=ROWS, layers=3, heads=2, max_blocks=MAX_PAGES * PAGE // wise_config.block_size)
    args.update(kw)
    return ws.create(wise_config, **args)


def huginn_step(params, **changed):
    args = dict(cache=huginn_cache, tokens=lambda: TOKENS, state=lambda: jnp.zeros((ROWS, 128)), tags=lambda: TAGS,
                num_steps=STEPS, wise_config=WISE_2, wise_state=huginn_state, adaptive=None, config=HUGINN)
    args.update(changed)
    made = {k: v() if callable(v) else v for k, v in args.items()}
    return hg.decode_step(params, made["config"], made["cache"], made["tokens"], made["state"], made["tags"],
                          num_steps=made["num_steps"], kernel="reference", wise_config=made["wise_config"],
                          wise_state=made["wise_state"], adaptive=made["adaptive"])


def _other_kv(head_dim=64, kv_heads=2):
    shape = (HUGINN_PLANES, 5, PAGE, kv_heads, head_dim)
    return dict(k=jnp.zeros(shape), v=jnp.zeros(shape))


HUGINN_DECODE_CASES = [
    ("planes", dict(cache=lambda: huginn_cache(planes=num_planes(HUGINN, 1)), num_steps=STEPS),
     r"the cache holds 6 planes; 2 core iterations need 9 \(prelude 1 \+ coda 2 \+ num_steps x 3 core layers"),
    ("kv_heads", dict(cache=lambda: huginn_cache(**_other_kv(kv_heads=1))),
     r"cache holds 1 kv_heads \(cache.k is float32\[9, 5, 32, 1, 64\]\); config.num_key_value_heads = 2"),
    ("head_dim", dict(cache=lambda: huginn_cache(**_other_kv(head_dim=32))),
     r"cache holds 32 head_dim .*config.head_dim = 64"),
    ("cache_dtype", dict(cache=lambda: huginn_cache(dtype=jnp.bfloat16)),
     r"cache holds bfloat16 K/V but the params compute in float32 \(params.wte\)"),
    ("cache_seq_lens", dict(cache=lambda: huginn_cache(seq_lens=jnp.zeros((3,), jnp.int32))),
     r"cache.seq_lens must be int32\[2\] \(page_table has 2 rows\), got int32\[3\]"),
    ("cache_type", dict(cache=lambda: {"k": 0}), r"cache must be a PagedKVCache .*got dict"),
    ("tokens_rows", dict(tokens=lambda: jnp.zeros((3,), jnp.int32)),
     r"tokens must be an integer array \[rows=2\] .*got int32\[3\]"),
    ("tags_float", dict(tags=lambda: jnp.zeros((ROWS,), jnp.float32)), r"tags must be .*got float32\[2\]"),
    ("state_width", dict(state=lambda: jnp.zeros((ROWS, 64))),
     r"state must be a floating array \[rows, hidden_size\] = \[2, 128\] .*got float32\[2, 64\]"),
    ("state_rows", dict(state=lambda: jnp.zeros((1, 128))), r"state must be .*got float32\[1, 128\]"),
    ("state_int", dict(state=lambda: jnp.zeros((ROWS, 128), jnp.int32)), r"state must be .*got int32\[2, 128\]"),
    ("num_steps", dict(num_steps=-1), r"num_steps must be a non-negative integer, got -1"),
    ("adaptive_type", dict(adaptive=0.5), r"adaptive must be None or a wise_core AdaptiveDepth, got float"),
    ("wise_state_without_wise", dict(wise_config=None), r"a wise_state is given but wise_config is None"),
    ("wise_config_type", dict(wise_config=0.95, wise_state=None), r"wise_config must be None .*got float"),
    ("depth_past_the_steps", dict(wise_config=WiseConfig(reuse_depths=(3,))),
     r"WISE depths \[3\] are out of range for num_steps=2 core iterations"),
    ("block_size_over_page", dict(wise_config=WiseConfig(block_size=64, reuse_depths=()),
                                  wise_state=lambda: huginn_state(WiseConfig(block_size=64, reuse_depths=()),
                                                                  max_blocks=1)),
     r"wise_config.block_size 64 does not divide the cache's page_size 32"),
    ("wise_state_missing", dict(wise_state=None), r"needs a wise_state of the core block's 3 layers, got none"),
    ("wise_state_layers", dict(wise_state=lambda: huginn_state(layers=6)),
     r"needs a wise_state of the core block's 3 layers, got one of 6 layers"),
    ("wise_state_heads", dict(wise_state=lambda: huginn_state(heads=4)),
     r"wise_state holds 4 heads .*config.num_attention_heads = 2"),
    ("wise_state_slots", dict(wise_state=lambda: huginn_state(slots=4)), r"wise_state holds 4 slots .*cache's rows"),
    ("wise_state_blocks", dict(wise_state=lambda: huginn_state(max_blocks=1)),
     r"wise_state holds supports of 1 blocks .*the step attends 2"),
    ("wise_state_other_config", dict(wise_state=lambda: huginn_state(WiseConfig(discover_depths=(0,),
                                                                                reuse_depths=(1,)))),
     r"wise_state was made for a WiseConfig of block_size 32, discover_depths \(0,\), reuse_depths \(1,\); "
     r"wise_config has block_size 32, discover_depths \(0, 1\), reuse_depths \(\)"),
]


@pytest.mark.parametrize("case,changed,match", HUGINN_DECODE_CASES, ids=[c[0] for c in HUGINN_DECODE_CASES])
def test_huginn_decode_step_refuses_a_mismatch(huginn_params, case, changed, match):
    """Each case changes one argument of a matching WISE step (discovery on both iterations)."""
    with pytest.raises((ValueError, TypeError, ConfigError), match=match):
        huginn_step(huginn_params, **changed)


HUGINN_PARAM_CASES = [   # (case, config the params are given with, message)
    ("hidden", dataclasses.replace(HUGINN, hidden_size=64, head_dim=32),
     r"params.wte is float32\[384, 128\]; the config's \[vocab_size, hidden_size\] is \[384, 64\]"),
    ("core_layers", dataclasses.replace(HUGINN, n_layers_in_recurrent_block=2, num_hidden_layers=5),
     r"params.core_block holds 3 layers, the config 2 \(config.n_layers_in_recurrent_block\)"),
    ("coda_layers", dataclasses.replace(HUGINN, n_layers_in_coda=1, num_hidden_layers=5),
     r"params.coda holds 2 layers, the config 1 \(config.n_layers_in_coda\)"),
    ("intermediate", dataclasses.replace(HUGINN, intermediate_size=128),
     r"params.prelude\[0\].fc is float32\[128, 512\]; the config's \[hidden_size, 2 \* intermediate_size\] is "
     r"\[128, 256\]"),
    ("qk_bias", dataclasses.replace(HUGINN, qk_bias=False), r"params.prelude\[0\].qkv_bias is given but config.qk_bias "
                                                            r"is False"),
    ("untied", dataclasses.replace(HUGINN, tie_word_embeddings=False),
     r"params.lm_head is None \(tied to wte\) but config.tie_word_embeddings is False"),
    ("ouro_config", CONFIG, r"config is an ouro model's; wise_jax.huginn runs Huginn models"),
]


@pytest.mark.parametrize("case,config,match", HUGINN_PARAM_CASES, ids=[c[0] for c in HUGINN_PARAM_CASES])
def test_huginn_params_that_do_not_match_the_config_are_refused_everywhere(huginn_params, case, config, match):
    """forward, prefill, prefill_chunk and decode_step (dense) refuse them, naming both sides."""
    cache = huginn_cache()
    seq_state = jnp.zeros((PAGE, 128))
    calls = [
        lambda: hg.forward(huginn_params, config, jnp.zeros((1, 4), jnp.int32), num_steps=STEPS),
        lambda: hg.prefill(huginn_params, config, jnp.zeros((PAGE,), jnp.int32), jnp.int32(3), seq_state,
                           num_steps=STEPS),
        lambda: hg.prefill_chunk(huginn_params, config, cache.k, cache.v, jnp.zeros((PAGE,), jnp.int32), jnp.int32(0),
                                 jnp.int32(3), jnp.zeros((1,), jnp.int32), seq_state, num_steps=STEPS),
        lambda: hg.decode_step(huginn_params, config, cache, TOKENS, jnp.zeros((ROWS, 128)), TAGS, num_steps=STEPS,
                               kernel="reference"),
    ]
    for call_ in calls:
        with pytest.raises(ValueError, match=match):
            call_()


def test_huginn_entry_points_refuse_ouro_params(params):
    with pytest.raises(TypeError, match=r"params must be wise_jax.huginn.HuginnParams .*got Ouro Params"):
        hg.forward(params, HUGINN, jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(TypeError, match=r"params must be wise_jax.huginn.HuginnParams"):
        hg.decode_step(params, HUGINN, huginn_cache(), TOKENS, jnp.zeros((ROWS, 128)), TAGS, num_steps=STEPS)


@pytest.mark.parametrize("case,changed,match", [
    ("tokens_two_dim", dict(tokens=jnp.zeros((1, PAGE), jnp.int32)),
     r"tokens must be a 1-D integer array \(one prompt\), got int32\[1, 32\]"),
    ("tokens_float", dict(tokens=jnp.zeros((PAGE,), jnp.float32)), r"tokens must be .*got float32\[32\]"),
    ("length_float", dict(length=jnp.float32(3)), r"length must be an integer scalar, got float32\[\]"),
    ("state_rows", dict(state=jnp.zeros((PAGE - 1, 128))),
     r"state must be a floating array \[seq \(tokens' length\), hidden_size\] = \[32, 128\] .*got float32\[31, 128\]"),
    ("num_steps", dict(num_steps=True), r"num_steps must be a non-negative integer, got True"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_huginn_prefill_refuses_a_mismatch(huginn_params, case, changed, match):
    args = dict(tokens=jnp.zeros((PAGE,), jnp.int32), length=jnp.int32(3), state=jnp.zeros((PAGE, 128)),
                num_steps=STEPS)
    args.update(changed)
    with pytest.raises(ValueError, match=match):
        hg.prefill(huginn_params, HUGINN, args["tokens"], args["length"], args["state"], num_steps=args["num_steps"])


@pytest.mark.parametrize("case,changed,match", [
    ("planes", dict(k=jnp.zeros((6, 5, PAGE, 2, 64)), v=jnp.zeros((6, 5, PAGE, 2, 64))),
     r"the K/V storage holds 6 planes; 2 core iterations need 9 .*k_pages is float32\[6, 5, 32, 2, 64\]"),
    ("v_shape", dict(v=jnp.zeros((HUGINN_PLANES, 4, PAGE, 2, 64))),
     r"k_pages and v_pages must be \[planes, pages \+ 1, page_size, kv_heads, head_dim\] of one shape"),
    ("dtype", dict(k=jnp.zeros((HUGINN_PLANES, 5, PAGE, 2, 64), jnp.bfloat16),
                   v=jnp.zeros((HUGINN_PLANES, 5, PAGE, 2, 64), jnp.bfloat16)),
     r"K/V storage holds bfloat16 K/V but the params compute in float32 \(params.wte\)"),
    ("tokens", dict(tokens=jnp.zeros((1, PAGE), jnp.int32)), r"tokens must be a 1-D integer array \(one prompt chunk\)"),
    ("start", dict(start=jnp.zeros((1,), jnp.int32)), r"start must be an integer scalar, got int32\[1\]"),
    ("table", dict(table=jnp.zeros((1, 1), jnp.int32)), r"table must be a 1-D integer array \(the request's pages\)"),
    ("state_table", dict(state_table=jnp.zeros((64, 127))),
     r"state_table must be a floating array \[positions, hidden_size = 128\] .*got float32\[64, 127\]"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_huginn_prefill_chunk_refuses_a_mismatch(huginn_params, case, changed, match):
    cache = huginn_cache()
    args = dict(k=cache.k, v=cache.v, tokens=jnp.zeros((PAGE,), jnp.int32), start=jnp.int32(PAGE),
                length=jnp.int32(3), table=jnp.zeros((2,), jnp.int32), state_table=jnp.zeros((64, 128)))
    args.update(changed)
    with pytest.raises(ValueError, match=match):
        hg.prefill_chunk(huginn_params, HUGINN, args["k"], args["v"], args["tokens"], args["start"], args["length"],
                         args["table"], args["state_table"], num_steps=STEPS)


def test_matching_huginn_calls_pass_every_check(huginn_params):
    """A cache of more iterations' planes than the call runs, a WISE state wider than the table,
    bf16 params with a bf16 cache: accepted (the decodes themselves are tested elsewhere)."""
    checks.huginn_decode_step(huginn_params, HUGINN, huginn_cache(planes=num_planes(HUGINN, 4)), TOKENS,
                              jnp.zeros((ROWS, 128), jnp.bfloat16), np.arange(ROWS), STEPS, WISE_2,
                              huginn_state(WISE_2, max_blocks=8), AdaptiveDepth())
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), huginn_params)
    cache = huginn_cache(dtype=jnp.bfloat16)
    checks.huginn_decode_step(half, HUGINN, cache, TOKENS, jnp.zeros((ROWS, 128)), TAGS, STEPS, None, None, None)
    checks.huginn_prefill_chunk(half, HUGINN, cache.k, cache.v, jnp.zeros((PAGE,), jnp.int32), 0, 3,
                                jnp.zeros((2,), jnp.int32), jnp.zeros((64, 128), jnp.bfloat16), STEPS)
