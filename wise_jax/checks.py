"""Input checks of wise_jax's public functions: what each is given against the ModelConfig and
WiseConfig it is given, before anything is traced.

Every check reads only Python values, shapes, dtypes and pytree structure, never an array's
values, so it runs once per trace of a jitted caller and costs nothing in the compiled step.
A mismatch raises ValueError (TypeError for a value of the wrong kind) naming the argument and
both sides: what it holds and what the config says it must hold. The entry points call one
function here as their first line:

    model.forward / forward_with_exits    -> params, forward_inputs (input_ids: model.check_input_ids)
    model.prefill, serving.prefill        -> prefill
    model.decode_step (serving, sharding) -> decode_step
    kv_cache.insert, serving.insert       -> request_kv
    kv_cache.create                       -> cache_settings
    wise_state.create                     -> state_settings
    huginn.forward                        -> huginn_params (input_ids: model.check_input_ids)
    huginn.prefill                        -> huginn_prefill
    huginn.prefill_chunk                  -> huginn_prefill_chunk
    huginn.decode_step                    -> huginn_decode_step

The cache, the WISE state and Huginn's params are recognised by their fields (this module sits
below `kv_cache`, `wise_state` and `huginn`, which call it); the decode kernels check the decode contract at
their own entry (`wise_jax.decode_check`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.huginn_reference import num_planes
from wise_core.kv_quant import check_kv_cache_dtype
from wise_core.model_config import ModelConfig
from wise_core.wise_config import WiseConfig
from wise_jax.params import LayerParams, Params, param_shapes

CACHE_FIELDS = ("k", "v", "page_table", "seq_lens", "free_pages", "num_free", "overflowed")
STATE_FIELDS = ("support", "tag", "tag_position", "depths_run", "fallbacks", "selected_blocks",
                "causal_blocks", "block_size", "discover_depths", "reuse_depths")

# What each Params leaf spans, in config fields (the layer axis first where the layers are stacked).
PARAM_SPANS = {
    "embed_tokens": "[vocab_size, hidden_size]",
    "norm": "[hidden_size]",
    "early_exit_gate": "[hidden_size, 1]",
    "early_exit_gate_bias": "[1]",
    "lm_head": "[hidden_size, vocab_size]",
    "qkv_proj": "[hidden_size, (num_attention_heads + 2 * num_key_value_heads) * head_dim]",
    "o_proj": "[num_attention_heads * head_dim, hidden_size]",
    "gate_up_proj": "[hidden_size, 2 * intermediate_size]",
    "down_proj": "[intermediate_size, hidden_size]",
}


def _shape(x) -> tuple[int, ...] | None:
    shape = getattr(x, "shape", None)
    return None if shape is None else tuple(shape)


def described(x) -> str:
    """dtype[shape] of an array (or abstract value), else its type's name."""
    if _shape(x) is None or not hasattr(x, "dtype"):
        return type(x).__name__
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def _is_integer_array(x) -> bool:
    return _shape(x) is not None and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _architecture(config, architecture: str, what: str, runs: str) -> None:
    """config must be a ModelConfig of an `architecture` model, else an error saying what `runs` it."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"{what} must be a wise_core ModelConfig, got {type(config).__name__}")
    if config.architecture != architecture:
        article = "an" if config.architecture[:1] in tuple("aeiou") else "a"
        raise ValueError(f"{what} is {article} {config.architecture} model's; {runs}")


def config_of(config, what: str = "config") -> None:
    """config must be a ModelConfig of an Ouro model (wise_jax.huginn runs Huginn's)."""
    _architecture(config, "ouro", what, "this function runs Ouro models (wise_jax.huginn runs Huginn's)")


def params(params, config: ModelConfig, what: str = "params") -> None:
    """params (wise_jax Params: stacked or unstacked layers, fused or split projections; or
    sharding.MeshParams, whose leaves keep the global shapes) against config's widths, layer
    count and tied embeddings; every leaf floating."""
    config_of(config)
    inner = getattr(params, "params", None)
    if not isinstance(params, Params) and isinstance(inner, Params) and hasattr(params, "size"):
        params, what = inner, f"{what}.params"   # MeshParams: the global shapes, columns reordered
    if not isinstance(params, Params):
        raise TypeError(f"{what} must be wise_jax Params (an Ouro model, wise_jax.load_model / init_params), "
                        f"got {type(params).__name__}")
    want = param_shapes(config)
    if (params.lm_head is None) != config.tie_word_embeddings:
        raise ValueError(f"{what}.lm_head is {'None (tied to the embeddings)' if params.lm_head is None else 'given'} "
                         f"but config.tie_word_embeddings is {config.tie_word_embeddings}")
    for name in ("embed_tokens", "norm", "early_exit_gate", "early_exit_gate_bias", "lm_head"):
        leaf = getattr(params, name)
        if leaf is not None:
            _leaf(leaf, getattr(want, name), f"{what}.{name}", PARAM_SPANS[name])
    layers, count = params.layers, config.num_hidden_layers
    if isinstance(layers, tuple):                           # unstack_layers: one LayerParams per layer
        if len(layers) != count:
            raise ValueError(f"{what} hold {len(layers)} layers, the config {count} (num_hidden_layers)")
        for n, layer in enumerate(layers):
            _layer(layer, want.layers, f"{what}.layers[{n}]", stacked=None)
    else:
        _layer(layers, want.layers, f"{what}.layers", stacked=count)


def _layer(layer, want: LayerParams, what: str, stacked: int | None) -> None:
    """One LayerParams against the fused shapes `want` ([layers, ...]); stacked: the layer
    count of a stacked leaf's first axis, None for one layer's leaves."""
    if not isinstance(layer, LayerParams):
        raise TypeError(f"{what} must be wise_jax LayerParams, got {type(layer).__name__}")
    if stacked is not None:
        first = _shape(layer.o_proj)
        if first and first[0] != stacked:
            raise ValueError(f"{what.split('.')[0]} hold {first[0]} layers, the config {stacked} (num_hidden_layers)")
    lead = "[layers, " if stacked is not None else "["
    for field in dataclasses.fields(want):
        name, shape = field.name, getattr(want, field.name)
        shape = shape if stacked is not None else shape[1:]
        leaf, span = getattr(layer, name), PARAM_SPANS.get(name, "[hidden_size]")
        span = lead + span[1:]
        if isinstance(leaf, tuple):                          # split_projections: the parts along the last axis
            total = sum((_shape(part) or (0,))[-1] for part in leaf)
            parts = [(_shape(part) or ())[:-1] for part in leaf]
            if any(p != shape[:-1] for p in parts) or total != shape[-1]:
                got = " | ".join(described(part) for part in leaf)
                raise ValueError(f"{what}.{name} holds parts {got}; the config's {span} is {list(shape)} "
                                 f"(the parts' last axes summing to it)")
            for n, part in enumerate(leaf):
                _floating(part, f"{what}.{name}[{n}]")
        else:
            _leaf(leaf, shape, f"{what}.{name}", span)


def _leaf(leaf, shape: tuple[int, ...], what: str, span: str) -> None:
    if _shape(leaf) != tuple(shape):
        raise ValueError(f"{what} is {described(leaf)}; the config's {span} is {list(shape)}")
    _floating(leaf, what)


def _floating(leaf, what: str) -> None:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        raise ValueError(f"{what} is {described(leaf)}; model weights must be floating")


def _fields(x, fields: tuple[str, ...], what: str, kind: str) -> None:
    missing = [f for f in fields if not hasattr(x, f)]
    if missing:
        raise TypeError(f"{what} must be a {kind}, got {type(x).__name__} (no {missing[0]!r})")


def forward_inputs(input_ids, positions, segment_ids, return_hidden) -> None:
    """`model.forward` / `forward_with_exits`: positions and segment_ids None or integer arrays of
    input_ids' shape [batch, seq]; return_hidden a bool (it picks what is returned)."""
    shape = _shape(input_ids)
    for name, x in (("positions", positions), ("segment_ids", segment_ids)):
        if x is not None and (not _is_integer_array(x) or _shape(x) != shape):
            raise ValueError(f"{name} must be None or an integer array [batch, seq] = {list(shape)} (input_ids' "
                             f"shape), got {described(x)}")
    if not isinstance(return_hidden, bool):
        raise TypeError(f"return_hidden must be a bool (it picks what forward returns), got "
                        f"{type(return_hidden).__name__}")


def compute_dtype(params) -> jnp.dtype:
    """The dtype the model computes in: its embeddings'."""
    inner = getattr(params, "params", params)
    return jnp.dtype(inner.embed_tokens.dtype)


def prefill(params_, config: ModelConfig, tokens, length=None) -> None:
    """`model.prefill` / `serving.prefill`: params against config; tokens a 1-D integer array
    (or a token-id sequence, serving's) and length an integer scalar when given."""
    params(params_, config)
    if _shape(tokens) is not None and (not _is_integer_array(tokens) or len(_shape(tokens)) != 1):
        raise ValueError(f"tokens must be a 1-D integer array (one prompt), got {described(tokens)}")
    if length is not None and not _is_int(length) and (not _is_integer_array(length) or _shape(length) != ()):
        raise ValueError(f"length must be an integer scalar, got {described(length)}")


def planes_of(config: ModelConfig) -> int:
    """Planes of an Ouro model's cache: one per (loop, layer)."""
    return config.total_ut_steps * config.num_hidden_layers


def cache_settings(config: ModelConfig, *, batch, max_pages, num_pages, page_size, dtype, planes,
                   kv_cache_dtype="auto") -> None:
    """`kv_cache.create`'s arguments: positive integer sizes; a floating dtype; planes None or
    an Ouro model's loops x layers, given for a Huginn model (`huginn_reference.num_planes`:
    prelude + coda + a whole number of core iterations); kv_cache_dtype "auto" or "fp8" (an
    Ouro model's only, so far)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "fp8" and getattr(config, "architecture", None) == "huginn":
        raise ValueError("kv_cache_dtype='fp8' is not implemented for Huginn models yet (an Ouro model's cache only)")
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a wise_core ModelConfig, got {type(config).__name__}")
    for name, value in (("batch", batch), ("max_pages", max_pages), ("num_pages", num_pages),
                        ("page_size", page_size)):
        if not _is_int(value) or value <= 0:
            raise ValueError(f"PagedKVCache {name} must be a positive integer, got {value!r}")
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"PagedKVCache dtype must be a floating dtype (the model's), got {dtype!r}")
    if planes is not None and (not _is_int(planes) or planes <= 0):
        raise ValueError(f"PagedKVCache planes must be a positive integer, got {planes!r}")
    if config.architecture == "huginn":
        outer = config.n_layers_in_prelude + config.n_layers_in_coda
        core = config.n_layers_in_recurrent_block
        if planes is None or planes <= outer or (planes - outer) % core:
            raise ValueError(f"a Huginn cache takes planes = prelude + coda + steps x core layers ({outer} + steps x "
                             f"{core}, wise_core.huginn_reference.num_planes), got planes={planes!r}")
    elif planes is not None and planes != planes_of(config):
        raise ValueError(f"PagedKVCache planes={planes} but the config runs {config.total_ut_steps} loops x "
                         f"{config.num_hidden_layers} layers = {planes_of(config)} planes")


def cache(cache_, config: ModelConfig, dtype=None, what: str = "cache") -> None:
    """A PagedKVCache against an Ouro config: k, v [loops x layers planes, pages + 1, page_size,
    num_key_value_heads, head_dim] of one floating dtype (`dtype`, the params', when given), or
    of an fp8 cache uint8 codes with float32 scales k_scale, v_scale of their shape without
    head_dim (any params' dtype: attention reads them dequantized to it); the bookkeeping arrays
    of `kv_cache.create`'s shapes and dtypes."""
    _fields(cache_, CACHE_FIELDS, what, "PagedKVCache (wise_jax.kv_cache.create)")
    quantized = _scales(cache_, what)
    _storage(cache_.k, cache_.v, config, None if quantized else dtype, what, f"{what}.k", f"{what}.v",
             "params.embed_tokens", None, quantized=quantized)
    _bookkeeping(cache_, what)


def _scales(cache_, what: str) -> bool:
    """Whether the cache is an fp8 one (k_scale and v_scale given): then k_scale, v_scale float32
    [planes, pages + 1, page_size, kv_heads] (k's shape without head_dim) beside uint8 k, v."""
    k_scale, v_scale = getattr(cache_, "k_scale", None), getattr(cache_, "v_scale", None)
    if k_scale is None and v_scale is None:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError(f"{what}.k_scale and {what}.v_scale must both be None (an unquantized cache) or both be "
                         f"float32 scales (an fp8 cache), got {described(k_scale)} and {described(v_scale)}")
    want = _shape(cache_.k)[:-1] if _shape(cache_.k) else None
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if _shape(x) != want or x.dtype != jnp.float32:
            raise ValueError(f"{what}.{name} must be float32{list(want or ())} ({what}.k's shape without head_dim: "
                             f"one scale per (token, KV head)), got {described(x)}")
    return True


def _storage(k, v, config: ModelConfig, dtype, what: str, k_name: str, v_name: str, dtype_source: str,
             num_steps: int | None, quantized: bool = False) -> None:
    """K/V storage [planes, pages + 1, page_size, kv_heads, head_dim] against an Ouro config (num_steps
    None: loops x layers planes) or a Huginn one (at least `huginn_reference.num_planes(config,
    num_steps)` planes: a cache may hold more iterations' than a call runs), and the params' dtype;
    quantized: an fp8 cache's uint8 codes (any params' dtype)."""
    if _shape(k) is None or len(_shape(k)) != 5 or _shape(v) != _shape(k):
        raise ValueError(f"{k_name} and {v_name} must be [planes, pages + 1, page_size, kv_heads, head_dim] of one "
                         f"shape, got {described(k)} and {described(v)}")
    planes, _, _, kv_heads, head_dim = _shape(k)
    if num_steps is not None and planes < num_planes(config, num_steps):
        raise ValueError(f"the {what} holds {planes} planes; {num_steps} core iterations need "
                         f"{num_planes(config, num_steps)} (prelude {config.n_layers_in_prelude} + coda "
                         f"{config.n_layers_in_coda} + num_steps x {config.n_layers_in_recurrent_block} core layers, "
                         f"wise_core.huginn_reference.num_planes; {k_name} is {described(k)})")
    want = {"kv_heads": (kv_heads, config.num_key_value_heads, "config.num_key_value_heads"),
            "head_dim": (head_dim, config.head_dim, "config.head_dim")}
    if num_steps is None:
        want = {"planes": (planes, planes_of(config),
                           f"config.total_ut_steps x num_hidden_layers = {config.total_ut_steps} x "
                           f"{config.num_hidden_layers}"), **want}
    for name, (got, expected, source) in want.items():
        if got != expected:
            raise ValueError(f"{what} holds {got} {name} ({k_name} is {described(k)}); {source} = {expected}")
    if quantized:
        if k.dtype != jnp.uint8 or v.dtype != jnp.uint8:
            raise ValueError(f"{k_name} and {v_name} of an fp8 cache must be uint8 codes, got {described(k)} and "
                             f"{described(v)}")
        return
    if k.dtype != v.dtype or not jnp.issubdtype(k.dtype, jnp.floating):
        raise ValueError(f"{k_name} and {v_name} must share one floating dtype, got {described(k)} and "
                         f"{described(v)}")
    if dtype is not None and jnp.dtype(k.dtype) != jnp.dtype(dtype):
        raise ValueError(f"{what} holds {jnp.dtype(k.dtype).name} K/V but the params compute in "
                         f"{jnp.dtype(dtype).name} ({dtype_source}): make the cache in the params' dtype")


def _bookkeeping(cache_, what: str) -> None:
    """A PagedKVCache's page table, lengths, free count and overflow flag of `kv_cache.create`'s
    shapes and dtypes."""
    table = _shape(cache_.page_table)
    if table is None or len(table) != 2 or cache_.page_table.dtype != jnp.int32:
        raise ValueError(f"{what}.page_table must be int32[rows, max_pages], got {described(cache_.page_table)}")
    rows = table[0]
    for name, shape, dtype_ in (("seq_lens", (rows,), jnp.int32), ("num_free", (), jnp.int32),
                                ("overflowed", (), jnp.bool_)):
        x = getattr(cache_, name)
        if _shape(x) != shape or x.dtype != dtype_:
            raise ValueError(f"{what}.{name} must be {jnp.dtype(dtype_).name}{list(shape)} (page_table has {rows} "
                             f"rows), got {described(x)}")


def request_kv(cache_, k, v, length=None) -> None:
    """`kv_cache.insert` / `serving.insert`: one request's k, v [planes, n * page_size, kv_heads,
    head_dim] against the cache's planes, heads, head_dim, dtype and page size."""
    _fields(cache_, CACHE_FIELDS, "cache", "PagedKVCache (wise_jax.kv_cache.create)")
    if _shape(k) is None or len(_shape(k)) != 4 or _shape(v) != _shape(k):
        raise ValueError(f"the request's k and v must be [planes, positions, kv_heads, head_dim] of one shape, "
                         f"got {described(k)} and {described(v)}")
    planes, span, kv_heads, head_dim = _shape(k)
    c_planes, _, page_size, c_heads, c_dim = _shape(cache_.k)
    for name, got, want in (("planes", planes, c_planes), ("kv_heads", kv_heads, c_heads),
                            ("head_dim", head_dim, c_dim)):
        if got != want:
            raise ValueError(f"the request's K/V hold {got} {name} (k is {described(k)}), the cache {want} "
                             f"(cache.k is {described(cache_.k)})")
    if _scales(cache_, "cache"):    # an fp8 cache quantizes K/V of any floating dtype
        if k.dtype != v.dtype or not jnp.issubdtype(k.dtype, jnp.floating):
            raise ValueError(f"the request's K/V must share one floating dtype (an fp8 cache quantizes them), got "
                             f"{described(k)} and {described(v)}")
    elif k.dtype != cache_.k.dtype or v.dtype != cache_.k.dtype:
        raise ValueError(f"the request's K/V are {jnp.dtype(k.dtype).name}, the cache "
                         f"{jnp.dtype(cache_.k.dtype).name}: prefill with params of the cache's dtype")
    max_pages = _shape(cache_.page_table)[1]
    if span % page_size or span // page_size > max_pages:
        raise ValueError(f"K/V of {span} positions is not a whole number of pages of {page_size} "
                         f"within the {max_pages} a row holds")
    if length is not None and not _is_int(length) and (not _is_integer_array(length) or _shape(length) != ()):
        raise ValueError(f"length must be an integer scalar, got {described(length)}")


def state_settings(wise_config, *, slots, layers, heads, max_blocks) -> None:
    """`wise_state.create`'s arguments: a WiseConfig and positive integer sizes."""
    if not isinstance(wise_config, WiseConfig):
        raise TypeError(f"wise_config must be a wise_core WiseConfig, got {type(wise_config).__name__}")
    for name, value in (("slots", slots), ("layers", layers), ("heads", heads), ("max_blocks", max_blocks)):
        if not _is_int(value) or value <= 0:
            raise ValueError(f"WiseState {name} must be a positive integer, got {value!r}")


def wise_config_for(wise_config, config: ModelConfig, page_size: int) -> None:
    """A WiseConfig for a model of config.total_ut_steps loops and a cache of page_size."""
    if not isinstance(wise_config, WiseConfig):
        raise TypeError(f"wise_config must be None (dense) or a wise_core WiseConfig, got {type(wise_config).__name__}")
    bad = [d for d in wise_config.discover_depths + wise_config.reuse_depths if d >= config.total_ut_steps]
    if bad:
        raise ValueError(f"wise_config depths {bad} (discover_depths {wise_config.discover_depths}, reuse_depths "
                         f"{wise_config.reuse_depths}) are out of range for config.total_ut_steps = "
                         f"{config.total_ut_steps} loops")
    if page_size % wise_config.block_size:
        raise ValueError(f"wise_config.block_size {wise_config.block_size} does not divide the cache's page_size "
                         f"{page_size}")


def state(state_, wise_config: WiseConfig, config: ModelConfig, *, rows: int, blocks: int,
          what: str = "state") -> None:
    """A WiseState against the WiseConfig it serves (its block size and depths), the model's
    layers and heads, the step's rows and the blocks its attention reads (at least)."""
    _fields(state_, STATE_FIELDS, what, "WiseState (wise_jax.wise_state.create)")
    made = (state_.block_size, state_.discover_depths, state_.reuse_depths)
    given = (wise_config.block_size, wise_config.discover_depths, wise_config.reuse_depths)
    if made != given:
        raise ValueError(f"{what} was made for a WiseConfig of block_size {made[0]}, discover_depths {made[1]}, "
                         f"reuse_depths {made[2]}; wise_config has block_size {given[0]}, discover_depths "
                         f"{given[1]}, reuse_depths {given[2]}")
    support = _shape(state_.support)
    if support is None or len(support) != 4 or state_.support.dtype != jnp.bool_:
        raise ValueError(f"{what}.support must be bool[layers, slots, heads, max_blocks], got "
                         f"{described(state_.support)}")
    layers, slots, heads, max_blocks = support
    for name, got, want, source in (("layers", layers, config.loop_layers, "config.loop_layers"),
                                    ("slots", slots, rows, "the cache's rows (page_table.shape[0])"),
                                    ("heads", heads, config.num_attention_heads, "config.num_attention_heads")):
        if got != want:
            raise ValueError(f"{what} holds {got} {name} ({what}.support is {described(state_.support)}); "
                             f"{source} = {want}")
    if max_blocks < blocks:
        raise ValueError(f"{what} holds supports of {max_blocks} blocks ({what}.support is "
                         f"{described(state_.support)}); the step attends {blocks} (its pages x page_size / "
                         f"block_size {wise_config.block_size})")
    n_reuse = len(wise_config.reuse_depths)
    for name, shape, dtype in (("tag", (layers, slots), jnp.int32), ("tag_position", (layers, slots), jnp.int32),
                               ("depths_run", (layers, slots), jnp.int32), ("fallbacks", (), jnp.int32),
                               ("selected_blocks", (n_reuse,), jnp.float32),
                               ("causal_blocks", (n_reuse,), jnp.float32)):
        x = getattr(state_, name)
        if _shape(x) != shape or x.dtype != dtype:
            raise ValueError(f"{what}.{name} must be {jnp.dtype(dtype).name}{list(shape)}, got {described(x)}")


def rows_of(x, name: str, rows: int) -> None:
    """x must be an integer array [rows] (one value per cache row)."""
    if not _is_integer_array(x) or _shape(x) != (rows,):
        raise ValueError(f"{name} must be an integer array [rows={rows}] (one per cache row, "
                         f"cache.page_table.shape[0]), got {described(x)}")


def decode_step(params_, config: ModelConfig, cache_, state_, tokens, tags, wise_config, width) -> None:
    """`model.decode_step`'s arguments against each other and the configs (module docstring)."""
    params(params_, config)
    cache(cache_, config, compute_dtype(params_))
    rows, max_pages = _shape(cache_.page_table)
    page_size = _shape(cache_.k)[2]
    rows_of(tokens, "tokens", rows)
    rows_of(tags, "tags", rows)
    if width is not None and (not _is_int(width) or not 1 <= width <= max_pages):
        raise ValueError(f"width must be None or an integer in [1, {max_pages}] (the cache's max_pages), "
                         f"got {width!r}")
    if wise_config is None:
        if state_ is not None:
            raise ValueError("a WISE state is given but wise_config is None: the step would run dense and leave "
                             "it unused; pass the WiseConfig it was made for, or state=None")
        return
    wise_config_for(wise_config, config, page_size)
    if state_ is None:
        raise ValueError("wise_config is given but state is None: a WISE step needs a WiseState "
                         "(wise_jax.wise_state.create(wise_config, slots=rows, layers=config.num_hidden_layers, "
                         "heads=config.num_attention_heads, max_blocks=max_pages * page_size // block_size))")
    pages = max_pages if width is None else width
    state(state_, wise_config, config, rows=rows, blocks=pages * page_size // wise_config.block_size)


# -- Huginn (wise_jax.huginn) ----------------------------------------------------------------------
HUGINN_FIELDS = ("wte", "prelude", "adapter", "core_block", "coda", "ln_f", "lm_head")
BLOCK_FIELDS = ("qkv", "qkv_bias", "proj", "fc", "mlp_proj", "norm_1", "norm_2", "norm_3", "norm_4")


def huginn_config(config, what: str = "config") -> None:
    """config must be a ModelConfig of a Huginn model (wise_jax.model runs Ouro's)."""
    _architecture(config, "huginn", what, "wise_jax.huginn runs Huginn models (wise_jax.model runs Ouro's)")


def num_steps(value) -> int:
    """Core iterations: a non-negative int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"num_steps must be a non-negative integer, got {value!r}")
    return value


def huginn_params(params_, config: ModelConfig, what: str = "params") -> None:
    """HuginnParams (`huginn.huginn_from_tensors`) against a Huginn config: wte [vocab_size,
    hidden_size]; adapter [2 * hidden_size, hidden_size]; ln_f [hidden_size]; lm_head
    [hidden_size, vocab_size], None exactly when tie_word_embeddings; prelude, core_block and
    coda tuples of n_layers_in_prelude, n_layers_in_recurrent_block and n_layers_in_coda
    BlockParams: qkv [hidden_size, 3 * heads * head_dim], qkv_bias [3 * heads * head_dim]
    exactly when qk_bias (else None), proj [heads * head_dim, hidden_size], fc [hidden_size,
    2 * intermediate_size], mlp_proj [intermediate_size, hidden_size], norm_1..4 [hidden_size];
    every leaf floating."""
    huginn_config(config)
    missing = [f for f in HUGINN_FIELDS if not hasattr(params_, f)]
    if missing:
        kind = "Ouro Params (wise_jax.model runs them)" if isinstance(params_, Params) else type(params_).__name__
        raise TypeError(f"{what} must be wise_jax.huginn.HuginnParams (wise_jax.load_model / huginn_from_tensors of "
                        f"a Huginn checkpoint), got {kind}")
    c = config
    hidden, vocab, width = c.hidden_size, c.vocab_size, c.num_attention_heads * c.head_dim
    for name, shape, span in (("wte", (vocab, hidden), "[vocab_size, hidden_size]"),
                              ("adapter", (2 * hidden, hidden), "[2 * hidden_size, hidden_size]"),
                              ("ln_f", (hidden,), "[hidden_size]")):
        _leaf(getattr(params_, name), shape, f"{what}.{name}", span)
    if (params_.lm_head is None) != c.tie_word_embeddings:
        raise ValueError(f"{what}.lm_head is {'None (tied to wte)' if params_.lm_head is None else 'given'} "
                         f"but config.tie_word_embeddings is {c.tie_word_embeddings}")
    if params_.lm_head is not None:
        _leaf(params_.lm_head, (hidden, vocab), f"{what}.lm_head", "[hidden_size, vocab_size]")
    block = {"qkv": ((hidden, 3 * width), "[hidden_size, 3 * num_attention_heads * head_dim]"),
             "qkv_bias": ((3 * width,), "[3 * num_attention_heads * head_dim]"),
             "proj": ((width, hidden), "[num_attention_heads * head_dim, hidden_size]"),
             "fc": ((hidden, 2 * c.intermediate_size), "[hidden_size, 2 * intermediate_size]"),
             "mlp_proj": ((c.intermediate_size, hidden), "[intermediate_size, hidden_size]"),
             **{f"norm_{i}": ((hidden,), "[hidden_size]") for i in range(1, 5)}}
    for stack, count, field in (("prelude", c.n_layers_in_prelude, "n_layers_in_prelude"),
                                ("core_block", c.n_layers_in_recurrent_block, "n_layers_in_recurrent_block"),
                                ("coda", c.n_layers_in_coda, "n_layers_in_coda")):
        blocks = getattr(params_, stack)
        if not isinstance(blocks, (tuple, list)) or len(blocks) != count:
            got = f"{len(blocks)} layers" if isinstance(blocks, (tuple, list)) else type(blocks).__name__
            raise ValueError(f"{what}.{stack} holds {got}, the config {count} (config.{field})")
        for n, bp in enumerate(blocks):
            name = f"{what}.{stack}[{n}]"
            _fields(bp, BLOCK_FIELDS, name, "wise_jax.huginn BlockParams")
            if (bp.qkv_bias is None) == c.qk_bias:
                raise ValueError(f"{name}.qkv_bias is {'None' if bp.qkv_bias is None else 'given'} but config.qk_bias "
                                 f"is {c.qk_bias}")
            for field_name, (shape, span) in block.items():
                leaf = getattr(bp, field_name)
                if leaf is not None:
                    _leaf(leaf, shape, f"{name}.{field_name}", span)


def _huginn_state(x, rows: int, config: ModelConfig, name: str, what: str) -> None:
    """A recurrent state: a floating array [rows, hidden_size]."""
    if _shape(x) != (rows, config.hidden_size) or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array [{what}, hidden_size] = [{rows}, {config.hidden_size}] "
                         f"(the initial recurrent state), got {described(x)}")


def _scalar(x, name: str) -> None:
    if not _is_int(x) and (not _is_integer_array(x) or _shape(x) != ()):
        raise ValueError(f"{name} must be an integer scalar, got {described(x)}")


def huginn_prefill(params_, config: ModelConfig, tokens, length, state_, steps) -> None:
    """`huginn.prefill`: params against config; tokens int[seq] (one prompt); length an integer
    scalar; state floating [seq, hidden_size]; num_steps a non-negative int."""
    huginn_params(params_, config)
    num_steps(steps)
    if not _is_integer_array(tokens) or len(_shape(tokens)) != 1:
        raise ValueError(f"tokens must be a 1-D integer array (one prompt), got {described(tokens)}")
    _scalar(length, "length")
    _huginn_state(state_, _shape(tokens)[0], config, "state", "seq (tokens' length)")


def huginn_prefill_chunk(params_, config: ModelConfig, k_pages, v_pages, tokens, start, length, table, state_table,
                         steps) -> None:
    """`huginn.prefill_chunk`: params against config; the K/V storage against config, num_steps
    and the params' dtype (`_storage`); tokens int[seq]; start and length integer scalars; table
    int[pages]; state_table floating [positions, hidden_size]."""
    huginn_params(params_, config)
    num_steps(steps)
    _storage(k_pages, v_pages, config, params_.wte.dtype, "K/V storage", "k_pages", "v_pages", "params.wte", steps)
    if not _is_integer_array(tokens) or len(_shape(tokens)) != 1:
        raise ValueError(f"tokens must be a 1-D integer array (one prompt chunk), got {described(tokens)}")
    _scalar(start, "start")
    _scalar(length, "length")
    if not _is_integer_array(table) or len(_shape(table)) != 1:
        raise ValueError(f"table must be a 1-D integer array (the request's pages), got {described(table)}")
    shape = _shape(state_table)
    if shape is None or len(shape) != 2 or shape[1] != config.hidden_size or not jnp.issubdtype(
            state_table.dtype, jnp.floating):
        raise ValueError(f"state_table must be a floating array [positions, hidden_size = {config.hidden_size}] "
                         f"(each position's initial state), got {described(state_table)}")


def huginn_decode_step(params_, config: ModelConfig, cache_, tokens, state_, tags, steps, wise_config, wise_state,
                       adaptive) -> None:
    """`huginn.decode_step`: params against config; the cache against config, num_steps and the
    params' dtype; tokens, tags int[rows] and state floating [rows, hidden_size], rows the cache's;
    wise_config None (dense, wise_state None too) or a WiseConfig of depths below num_steps and a
    block size dividing the page size, with a WiseState of the core block's layers made for it
    (`state`); adaptive None or an AdaptiveDepth."""
    huginn_params(params_, config)
    num_steps(steps)
    _fields(cache_, CACHE_FIELDS, "cache", "PagedKVCache (wise_jax.kv_cache.create)")
    if getattr(cache_, "k_scale", None) is not None:
        raise ValueError("an fp8 K/V cache (kv_cache_dtype='fp8') is not implemented for Huginn models yet")
    _storage(cache_.k, cache_.v, config, params_.wte.dtype, "cache", "cache.k", "cache.v", "params.wte", steps)
    _bookkeeping(cache_, "cache")
    rows, max_pages = _shape(cache_.page_table)
    page_size = _shape(cache_.k)[2]
    rows_of(tokens, "tokens", rows)
    rows_of(tags, "tags", rows)
    _huginn_state(state_, rows, config, "state", "rows")
    if adaptive is not None and not isinstance(adaptive, AdaptiveDepth):
        raise TypeError(f"adaptive must be None or a wise_core AdaptiveDepth, got {type(adaptive).__name__}")
    if wise_config is None:
        if wise_state is not None:
            raise ValueError("a wise_state is given but wise_config is None: the step would run dense and leave it "
                             "unused; pass the WiseConfig it was made for, or wise_state=None")
        return
    if not isinstance(wise_config, WiseConfig):
        raise TypeError(f"wise_config must be None (dense) or a wise_core WiseConfig, got {type(wise_config).__name__}")
    wise_config.validate_for(steps, f"num_steps={steps} core iterations")
    if page_size % wise_config.block_size:
        raise ValueError(f"wise_config.block_size {wise_config.block_size} does not divide the cache's page_size "
                         f"{page_size}")
    layers = config.n_layers_in_recurrent_block
    if wise_state is None or _shape(getattr(wise_state, "support", None)) is None \
            or _shape(wise_state.support)[0] != layers:
        got = "none" if wise_state is None else (f"one of {_shape(wise_state.support)[0]} layers"
                                                 if _shape(getattr(wise_state, "support", None)) else
                                                 type(wise_state).__name__)
        raise ValueError(f"WISE decode needs a wise_state of the core block's {layers} layers, got {got}")
    state(wise_state, wise_config, config, rows=rows, blocks=max_pages * page_size // wise_config.block_size,
          what="wise_state")
