"""Ouro parameters as pytrees, converted from and to the HF checkpoint layout.

Per-layer weights are stacked along a leading layer axis (the same weights serve every loop).
Linear weights are stored [in, out] (HF stores [out, in]) so the model computes `x @ w`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from wise_core.checkpoint import expected_shapes, validate_tensors
from wise_core.config import ModelConfig

# LayerParams field -> HF tensor name under `model.layers.{n}.`
LAYER_NAMES = {
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "input_layernorm": "input_layernorm.weight", "input_layernorm_2": "input_layernorm_2.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "post_attention_layernorm_2": "post_attention_layernorm_2.weight",
}
LINEAR_FIELDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(LAYER_NAMES), meta_fields=[])
@dataclasses.dataclass
class LayerParams:
    """Weights of all layers, stacked: linear [layers, in, out], norms [layers, hidden]."""

    q_proj: jax.Array
    k_proj: jax.Array
    v_proj: jax.Array
    o_proj: jax.Array
    gate_proj: jax.Array
    up_proj: jax.Array
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


def from_checkpoint_tensors(config: ModelConfig, tensors: dict[str, np.ndarray],
                            dtype=jnp.float32) -> Params:
    """HF-named numpy tensors (validated against `config`) -> Params of `dtype`."""
    validate_tensors(config, tensors)

    def put(array: np.ndarray) -> jax.Array:
        return jnp.asarray(np.asarray(array, np.float32)).astype(dtype)

    def stacked(field: str) -> jax.Array:
        per_layer = [tensors[f"model.layers.{n}.{LAYER_NAMES[field]}"]
                     for n in range(config.num_hidden_layers)]
        if field in LINEAR_FIELDS:
            per_layer = [w.T for w in per_layer]
        return put(np.stack(per_layer))

    return Params(
        embed_tokens=put(tensors["model.embed_tokens.weight"]),
        layers=LayerParams(**{field: stacked(field) for field in LAYER_NAMES}),
        norm=put(tensors["model.norm.weight"]),
        early_exit_gate=put(tensors["model.early_exit_gate.weight"].T),
        early_exit_gate_bias=put(tensors["model.early_exit_gate.bias"]),
        lm_head=None if config.tie_word_embeddings else put(tensors["lm_head.weight"].T),
    )


def to_checkpoint_tensors(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Params -> HF-named float32 numpy tensors (the layout `wise_core.checkpoint` saves)."""
    def get(array: jax.Array) -> np.ndarray:
        return np.asarray(jnp.asarray(array, jnp.float32))

    tensors = {
        "model.embed_tokens.weight": get(params.embed_tokens),
        "model.norm.weight": get(params.norm),
        "model.early_exit_gate.weight": get(params.early_exit_gate).T.copy(),
        "model.early_exit_gate.bias": get(params.early_exit_gate_bias),
    }
    for field, name in LAYER_NAMES.items():
        stacked = get(getattr(params.layers, field))
        for n in range(stacked.shape[0]):
            w = stacked[n]
            tensors[f"model.layers.{n}.{name}"] = w.T.copy() if field in LINEAR_FIELDS else w.copy()
    if params.lm_head is not None:
        tensors["lm_head.weight"] = get(params.lm_head).T.copy()
    validate_tensors(config, tensors)
    return tensors


def param_shapes(config: ModelConfig) -> Params:
    """The Params structure for `config` with shape tuples as leaves (the layout, not the values)."""
    hf = expected_shapes(config)
    layers = config.num_hidden_layers

    def layer_shape(field: str) -> tuple[int, ...]:
        shape = hf[f"model.layers.0.{LAYER_NAMES[field]}"]
        return (layers,) + (shape[::-1] if field in LINEAR_FIELDS else shape)

    return Params(
        embed_tokens=hf["model.embed_tokens.weight"],
        layers=LayerParams(**{field: layer_shape(field) for field in LAYER_NAMES}),
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
