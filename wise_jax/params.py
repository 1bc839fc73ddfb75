"""Ouro parameters as pytrees, converted from and to the HF checkpoint layout.

Per-layer weights are stacked along a leading layer axis (the same weights serve every loop);
`unstack_layers` makes them a tuple of per-layer weights, the layout the serving engine decodes
with (`stack_layers` undoes it).
Linear weights are stored [in, out] (HF stores [out, in]) so the model computes `x @ w`, and the
projections that read the same input are fused: `qkv_proj` holds q_proj | k_proj | v_proj and
`gate_up_proj` holds gate_proj | up_proj along the output axis, so a layer runs one GEMM for
each (the checkpoint keeps the HF names; `from_checkpoint_tensors` / `to_checkpoint_tensors`
concatenate and split).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from wise_core.checkpoint import expected_shapes, validate_tensors
from wise_core.model_config import ModelConfig

# LayerParams field -> the HF tensors under `model.layers.{n}.` it holds, in output-axis order
LAYER_NAMES = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
    "input_layernorm": ("input_layernorm.weight",), "input_layernorm_2": ("input_layernorm_2.weight",),
    "post_attention_layernorm": ("post_attention_layernorm.weight",),
    "post_attention_layernorm_2": ("post_attention_layernorm_2.weight",),
}
LINEAR_FIELDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(LAYER_NAMES), meta_fields=[])
@dataclasses.dataclass
class LayerParams:
    """Weights of all layers, stacked: qkv_proj [layers, hidden, (heads + 2 * kv_heads) * head_dim],
    o_proj [layers, heads * head_dim, hidden], gate_up_proj [layers, hidden, 2 * intermediate],
    down_proj [layers, intermediate, hidden], norms [layers, hidden]."""

    qkv_proj: jax.Array
    o_proj: jax.Array
    gate_up_proj: jax.Array
    down_proj: jax.Array
    input_layernorm: jax.Array
    input_layernorm_2: jax.Array
    post_attention_layernorm: jax.Array
    post_attention_layernorm_2: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["embed_tokens", "layers", "norm", "early_exit_gate",
                                "early_exit_gate_bias", "lm_head"], meta_fields=[])
@dataclasses.dataclass
class Params:
    """embed_tokens [vocab, hidden]; layers; norm [hidden]; early_exit_gate [hidden, 1] with bias [1];
    lm_head [hidden, vocab], or None when the embeddings are tied."""

    embed_tokens: jax.Array
    layers: LayerParams
    norm: jax.Array
    early_exit_gate: jax.Array
    early_exit_gate_bias: jax.Array
    lm_head: jax.Array | None


def _layer_shape(hf: dict, field: str, layers: int) -> tuple[int, ...]:
    """[layers, in, sum of outs] for a linear field (HF shapes are [out, in]), [layers, hidden] for a norm."""
    shapes = [hf[f"model.layers.0.{name}"] for name in LAYER_NAMES[field]]
    if field in LINEAR_FIELDS:
        return (layers, shapes[0][1], sum(s[0] for s in shapes))
    return (layers,) + shapes[0]


def to_checkpoint_tensors(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Params -> HF-named float32 numpy tensors (the layout `wise_core.checkpoint` saves)."""
    def get(array: jax.Array) -> np.ndarray:
        return np.asarray(jnp.asarray(array, jnp.float32))

    hf = expected_shapes(config)
    tensors = {
        "model.embed_tokens.weight": get(params.embed_tokens),
        "model.norm.weight": get(params.norm),
        "model.early_exit_gate.weight": get(params.early_exit_gate).T.copy(),
        "model.early_exit_gate.bias": get(params.early_exit_gate_bias),
    }
    for field, names in LAYER_NAMES.items():
        stacked = get(getattr(params.layers, field))
        for n in range(stacked.shape[0]):
            start = 0
            for name in names:
                if field in LINEAR_FIELDS:
                    width = hf[f"model.layers.{n}.{name}"][0]
                    tensors[f"model.layers.{n}.{name}"] = stacked[n, :, start:start + width].T.copy()
                    start += width
                else:
                    tensors[f"model.layers.{n}.{name}"] = stacked[n].copy()
    if params.lm_head is not None:
        tensors["lm_head.weight"] = get(params.lm_head).T.copy()
    validate_tensors(config, tensors)
    return tensors


def param_shapes(config: ModelConfig) -> Params:
    """The Params structure for `config` with shape tuples as leaves (the layout, not the values)."""
    if config.architecture != "ouro":
        raise ValueError(f"wise_jax's Ouro params take architecture 'ouro', got {config.architecture!r} (a Huginn "
                         f"model's params are wise_jax.huginn.HuginnParams)")
    hf = expected_shapes(config)
    return Params(
        embed_tokens=hf["model.embed_tokens.weight"],
        layers=LayerParams(**{field: _layer_shape(hf, field, config.num_hidden_layers) for field in LAYER_NAMES}),
        norm=hf["model.norm.weight"],
        early_exit_gate=hf["model.early_exit_gate.weight"][::-1],
        early_exit_gate_bias=hf["model.early_exit_gate.bias"],
        lm_head=None if config.tie_word_embeddings else hf["lm_head.weight"][::-1],
    )


def _is_shape(x) -> bool:
    return isinstance(x, tuple)


def abstract_params(config: ModelConfig, dtype=jnp.float32) -> Params:
    """Params of jax.ShapeDtypeStruct leaves for `config`."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)), param_shapes(config),
                        is_leaf=_is_shape)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random weights made on the default device (as `wise_core.checkpoint.random_tensors`:
    normal(0, std) matrices, unit norms, zero gate bias), without building them on the host."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]]

    @jax.jit
    def make(key):
        keys = jax.random.split(key, len(leaves))
        out = []
        for k, path, shape in zip(keys, paths, leaves):
            if "norm" in path:
                out.append(jnp.ones(shape, dtype))
            elif "bias" in path:
                out.append(jnp.zeros(shape, dtype))
            else:
                out.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
        return jax.tree.unflatten(treedef, out)

    return make(key)


def split_projections(config: ModelConfig, params: Params) -> Params:
    """The same weights with the fused projections split again: qkv_proj becomes the tuple
    (q, k, v) and gate_up_proj (gate, up), each [layers, in, out]. The model runs one GEMM per
    part for such params; this exists to measure what the fusion saves
    (benchmarks/engine/jax_generate_bench.py)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    qkv, gate_up = params.layers.qkv_proj, params.layers.gate_up_proj
    layers = dataclasses.replace(
        params.layers,
        qkv_proj=(qkv[..., :q], qkv[..., q:q + kv], qkv[..., q + kv:]),
        gate_up_proj=(gate_up[..., :config.intermediate_size], gate_up[..., config.intermediate_size:]))
    return dataclasses.replace(params, layers=layers)


def unstack_layers(params: Params) -> Params:
    """The same weights with the layer axis taken apart: `layers` becomes a tuple of one
    LayerParams per layer (leaves without the layer axis; sharded leaves keep their sharding on
    the other axes). The model runs such params as a Python loop over layers (straight-line code
    reading each layer's own buffers) instead of a scan whose steps slice the stacked weights,
    which XLA does by copying them. Copies the weights once; unstacked params are returned as
    they are."""
    if isinstance(params.layers, tuple):
        return params
    return _unstack(params)


@jax.jit
def _unstack(params: Params) -> Params:
    count = jax.tree.leaves(params.layers)[0].shape[0]
    return dataclasses.replace(params, layers=tuple(jax.tree.map(lambda x, n=n: x[n], params.layers)
                                                    for n in range(count)))


def stack_layers(params: Params) -> Params:
    """The inverse of `unstack_layers` (stacked params are returned as they are); inside a
    traced function this is one copy of the layer weights."""
    if not isinstance(params.layers, tuple):
        return params
    return dataclasses.replace(params, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *params.layers))


def scale_queries(config: ModelConfig, params: Params, factor: float) -> Params:
    """params with q_proj multiplied by `factor` (random weights with peaked attention, for
    benchmarks: a larger factor concentrates each query's softmax on fewer keys)."""
    q = config.num_attention_heads * config.head_dim
    qkv = params.layers.qkv_proj
    qkv = qkv.at[..., :q].multiply(jnp.asarray(factor, qkv.dtype))
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, qkv_proj=qkv))
