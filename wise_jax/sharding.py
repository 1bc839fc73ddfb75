"""Tensor parallelism over a `jax.sharding.Mesh`: attention heads, KV heads and MLP columns
sharded over the mesh axis "tp" (other axes of the mesh replicate).

Device r of the axis's N holds query heads [r H/N, (r+1) H/N), KV heads [r KV/N, (r+1) KV/N) and
MLP columns [r I/N, (r+1) I/N), as `wise_torch.parallel`'s ranks do:
- params (`shard_params` -> `MeshParams`): qkv_proj's columns reordered rank-major (device r's block is
  q_r | k_r | v_r) and gate_up_proj's likewise (gate_r | up_r), both sharded on the output
  axis; o_proj and down_proj sharded on their input axis; embeddings, norms, the exit gate and
  the LM head replicated;
- the paged cache: k and v (and an fp8 cache's scales) sharded on kv_heads, page tables,
  lengths and the free stack replicated; the WISE state: support sharded on heads, tags and counters replicated.
`decode_step` and `prefill` are `wise_jax.model`'s run per device by `jax.shard_map` at the
local config (heads, KV heads, intermediate / N): each device's attention -- the Pallas kernel
or the reference -- reads only its heads and its K/V, the o_proj and down_proj outputs are
psum'd over "tp" (partial sums in the params' dtype, one more rounding per sublayer than one
device), and the page bookkeeping runs replicated. The density counts of a step are each
device's heads' and are psum'd once per step.

    mesh = wise_jax.sharding.make_mesh(2)
    llm = wise_jax.LLM(params, config, mesh=mesh)        # or generate(..., mesh=mesh)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from wise_core.engine.args import check_pool_fits, host_available_bytes
from wise_core.model_config import ModelConfig
from wise_jax import kv_cache as kvc
from wise_jax import model
from wise_jax import wise_state as ws
from wise_jax.params import LayerParams, Params, stack_layers, unstack_layers

AXIS = "tp"
KV_SPEC = P(None, None, None, AXIS, None)          # [planes, pages, page_size, kv_heads, head_dim]
CACHE_SPECS = kvc.PagedKVCache(k=KV_SPEC, v=KV_SPEC, page_table=P(), seq_lens=P(), free_pages=P(), num_free=P(),
                               overflowed=P())
SCALE_SPEC = P(None, None, None, AXIS)             # an fp8 cache's scales [planes, pages, page_size, kv_heads]
REQUEST_KV_SPEC = P(None, None, AXIS, None)        # a prefill's k, v [planes, seq, kv_heads, head_dim]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"], meta_fields=["size"])
@dataclasses.dataclass
class MeshParams:
    """Params in the mesh layout of `size` devices along "tp" (`shard_params`): what the serving
    functions take with a mesh. A type of its own, so that params of one layout are never read as
    the other's."""

    params: Params
    size: int


def make_mesh(size: int | None = None, devices=None) -> Mesh:
    """A 1-D mesh with axis "tp" over the first `size` of `devices` (default: all of jax.devices())."""
    devices = list(jax.devices() if devices is None else devices)
    size = len(devices) if size is None else size
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= len(devices):
        hint = ""
        if devices and all(d.platform == "cpu" for d in devices) and isinstance(size, int) and size > len(devices):
            hint = (f"; on a CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={size} before jax is "
                    f"imported to split the host into {size} devices")
        raise ValueError(f"a mesh of {size!r} devices is not possible with {len(devices)} devices{hint}")
    return Mesh(np.array(devices[:size]), (AXIS,))


def tp_size(mesh: Mesh) -> int:
    """The mesh's size along "tp" (a ValueError for a mesh without that axis)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if AXIS not in mesh.axis_names:
        raise ValueError(f"the mesh has axes {mesh.axis_names}; the heads are split over an axis named {AXIS!r}")
    return mesh.shape[AXIS]


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """One device's config: heads, KV heads and intermediate size divided by `size` (which must
    divide the KV heads and the intermediate size)."""
    for name in ("num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % size:
            raise ValueError(f"a mesh axis {AXIS!r} of {size} devices does not divide the model's {name} "
                             f"({getattr(config, name)})")
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // size,
                               num_key_value_heads=config.num_key_value_heads // size,
                               intermediate_size=config.intermediate_size // size)


def _rank_major(w: jax.Array, sizes: list[int], size: int) -> jax.Array:
    """w [..., sum(sizes)], parts of `sizes` along the last axis -> each part cut in `size`
    pieces, reordered so that block r of the axis is (part 0 piece r | part 1 piece r | ...)."""
    parts = jnp.split(w, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    pieces = [jnp.split(p, size, axis=-1) for p in parts]
    return jnp.concatenate([piece[r] for r in range(size) for piece in pieces], axis=-1)


def param_specs(params: Params) -> Params:
    """The PartitionSpec of every leaf of mesh-layout params."""
    unstacked = isinstance(params.layers, tuple)
    first = params.layers[0] if unstacked else params.layers
    if isinstance(first.qkv_proj, tuple) or isinstance(first.gate_up_proj, tuple):
        raise ValueError("tensor parallelism shards the fused projections; these params are split "
                         "(params.split_projections)")
    lead = () if unstacked else (None,)      # the layer axis of stacked weights
    norm = P()
    layer = LayerParams(qkv_proj=P(*lead, None, AXIS), o_proj=P(*lead, AXIS, None), gate_up_proj=P(*lead, None, AXIS),
                        down_proj=P(*lead, AXIS, None), input_layernorm=norm, input_layernorm_2=norm,
                        post_attention_layernorm=norm, post_attention_layernorm_2=norm)
    layers = tuple(layer for _ in params.layers) if unstacked else layer
    return Params(embed_tokens=P(), layers=layers, norm=P(), early_exit_gate=P(), early_exit_gate_bias=P(),
                  lm_head=None if params.lm_head is None else P())


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def shard_params(config: ModelConfig, params: Params | MeshParams, mesh: Mesh) -> MeshParams:
    """Params (the standard layout of `wise_jax.params`) -> the mesh layout, placed on the mesh
    (module docstring); MeshParams of this mesh's size are returned as they are."""
    size = tp_size(mesh)
    local_config(config, size)
    if isinstance(params, MeshParams):
        return _layout_of(params, mesh)
    if not isinstance(params, Params):
        raise TypeError(f"params must be wise_jax Params, got {type(params).__name__}")
    params = stack_layers(params)    # sharded stacked; `unstack_mesh_params` takes them apart again
    specs = param_specs(params)
    d, inter = config.head_dim, config.intermediate_size
    layers = params.layers
    layers = dataclasses.replace(
        layers,
        qkv_proj=_rank_major(layers.qkv_proj, [config.num_attention_heads * d, config.num_key_value_heads * d,
                                               config.num_key_value_heads * d], size),
        gate_up_proj=_rank_major(layers.gate_up_proj, [inter, inter], size))
    return MeshParams(jax.device_put(dataclasses.replace(params, layers=layers), _named(mesh, specs)), size)


def unstack_mesh_params(params: MeshParams, mesh: Mesh) -> MeshParams:
    """`params.unstack_layers` in the mesh layout: every layer's leaves placed as `param_specs`
    says (the layer axis gone)."""
    params = _layout_of(params, mesh)
    if isinstance(params.params.layers, tuple):
        return params
    specs = param_specs(jax.eval_shape(unstack_layers, params.params))
    return MeshParams(jax.jit(unstack_layers, out_shardings=_named(mesh, specs))(params.params), params.size)


def _layout_of(params, mesh: Mesh | None):
    """The Params to run: plain params without a mesh, MeshParams of the mesh's size with one."""
    if mesh is None:
        if isinstance(params, MeshParams):
            raise ValueError(f"these params are in the layout of a {params.size}-device mesh; pass that mesh")
        return params
    if not isinstance(params, MeshParams):
        raise TypeError("with a mesh, params must be in its layout: wise_jax.sharding.shard_params(config, "
                        f"params, mesh), got {type(params).__name__}")
    if params.size != tp_size(mesh):
        raise ValueError(f"these params are in the layout of a {params.size}-device mesh, the mesh has "
                         f"{tp_size(mesh)} along {AXIS!r}")
    return params


def device_memory_available() -> tuple[int | None, str]:
    """(bytes free for new arrays on the default device, which memory that is): a GPU's
    allocator limit less what is in use, else the host's available memory."""
    device = jax.devices()[0]
    memory = (device.memory_stats() or {}) if device.platform == "gpu" else {}
    if "bytes_limit" in memory:
        return memory["bytes_limit"] - memory.get("bytes_in_use", 0), f"jax may still allocate on {device}"
    return host_available_bytes(), "of host memory available"


def cache_specs(cache: kvc.PagedKVCache) -> kvc.PagedKVCache:
    """The PartitionSpec of every array of a cache (CACHE_SPECS; an fp8 cache's scales sharded on
    kv_heads too)."""
    if not cache.quantized:
        return CACHE_SPECS
    return dataclasses.replace(CACHE_SPECS, k_scale=SCALE_SPEC, v_scale=SCALE_SPEC)


def create_cache(config: ModelConfig, mesh: Mesh | None, **kw) -> kvc.PagedKVCache:
    """`kv_cache.create(config, **kw)`, made sharded on the mesh (each device allocates only its
    KV heads), or on the default device without a mesh. A pool larger than the device's free
    memory is a ValueError saying the bytes it needs (`check_pool_fits`), before allocating."""
    local = config if mesh is None else local_config(config, tp_size(mesh))
    check_pool_fits(kw["num_pages"], kvc.page_bytes(local, kw["page_size"], kw.get("dtype", jnp.float32),
                                                    kw.get("planes"), kw.get("kv_cache_dtype", "auto")),
                    *device_memory_available())
    if mesh is None:
        return kvc.create(config, **kw)
    specs = cache_specs(jax.eval_shape(lambda: kvc.create(config, **kw)))
    return jax.jit(lambda: kvc.create(config, **kw), out_shardings=_named(mesh, specs))()


def state_specs(state: ws.WiseState) -> ws.WiseState:
    """The PartitionSpec of every array of a WISE state (of its layout: `state`'s static fields):
    support sharded on heads, tags and counters replicated."""
    replicated = {name: P() for name in ("tag", "tag_position", "depths_run", "fallbacks",
                                         "selected_blocks", "causal_blocks")}
    return dataclasses.replace(state, support=P(None, None, AXIS, None), **replicated)


def create_state(wise_config, mesh: Mesh | None, **kw) -> ws.WiseState:
    """`wise_state.create(wise_config, **kw)`, made sharded on the mesh (support on heads)."""
    if mesh is None:
        return ws.create(wise_config, **kw)
    specs = state_specs(jax.eval_shape(lambda: ws.create(wise_config, **kw)))
    return jax.jit(lambda: ws.create(wise_config, **kw), out_shardings=_named(mesh, specs))()


def decode_step(params: Params | MeshParams, config: ModelConfig, cache: kvc.PagedKVCache, state: ws.WiseState | None,
                tokens: jax.Array, tags: jax.Array, *, wise_config, kernel: str, unroll: int | bool = 1,
                mesh: Mesh | None = None, width: int | None = None, return_depths: bool = False,
                allocate: bool = True, scan_loops: bool = True):
    """`wise_jax.model.decode_step`; over the mesh (MeshParams, sharded cache and state) one
    shard_map'd step at the local config. Returns (logits float32[rows, vocab], cache, state),
    and with return_depths the loops each row ran (int32[rows])."""
    if mesh is None:
        return model.decode_step(_layout_of(params, None), config, cache, state, tokens, tags,
                                 wise_config=wise_config, kernel=kernel, unroll=unroll, width=width,
                                 return_depths=return_depths, allocate=allocate, scan_loops=scan_loops)
    params = _layout_of(params, mesh).params
    local = local_config(config, tp_size(mesh))

    def step(params, cache, state, tokens, tags):
        counting = None if state is None else dataclasses.replace(
            state, selected_blocks=jnp.zeros_like(state.selected_blocks),
            causal_blocks=jnp.zeros_like(state.causal_blocks))
        logits, cache, new, *depths = model.decode_step(
            params, local, cache, counting, tokens, tags, wise_config=wise_config, kernel=kernel, unroll=unroll,
            axis_name=AXIS, width=width, return_depths=return_depths, allocate=allocate,
            scan_loops=scan_loops)
        if state is not None:   # this step's counts of every device's heads, added to the totals
            new = dataclasses.replace(
                new, selected_blocks=state.selected_blocks + lax.psum(new.selected_blocks, AXIS),
                causal_blocks=state.causal_blocks + lax.psum(new.causal_blocks, AXIS))
        return (logits, cache, new, *depths)

    states = None if state is None else state_specs(state)
    depth_specs = (P(),) if return_depths else ()
    specs = cache_specs(cache)
    return jax.shard_map(step, mesh=mesh, in_specs=(param_specs(params), specs, states, P(), P()),
                         out_specs=(P(), specs, states, *depth_specs), check_vma=False)(
        params, cache, state, tokens, tags)


def prefill(params: Params | MeshParams, config: ModelConfig, tokens: jax.Array, length: jax.Array, *, attention: str = "auto",
            unroll: int | bool = 1, mesh: Mesh | None = None, all_logits: bool = False):
    """`wise_jax.model.prefill`; over the mesh, shard_map'd at the local config: the K/V come
    back sharded on kv_heads. Returns (logits float32[vocab] (all_logits: model.prefill's pair), k, v)."""
    if mesh is None:
        return model.prefill(_layout_of(params, None), config, tokens, length, attention=attention, unroll=unroll,
                             all_logits=all_logits)
    params = _layout_of(params, mesh).params
    local = local_config(config, tp_size(mesh))

    def run(params, tokens, length):
        return model.prefill(params, local, tokens, length, attention=attention, unroll=unroll, axis_name=AXIS,
                             all_logits=all_logits)

    return jax.shard_map(run, mesh=mesh, in_specs=(param_specs(params), P(), P()),
                         out_specs=(P(), REQUEST_KV_SPEC, REQUEST_KV_SPEC), check_vma=False)(params, tokens, length)
