"""Functional JAX implementation of the Ouro recurrent-depth decoder with WISE decode.

    config, params, tokenizer = wise_jax.load_model("ouro-py-3m", with_tokenizer=True)
    out = wise_jax.generate(params, config, ["def f("], max_new_tokens=16, wise_config=WiseConfig(),
                            tokenizer=tokenizer)

Research: `score` (teacher forcing) and `greedy`, pure and jittable over the functional API
(wise_jax.scoring). Serving: `prefill`, `insert`, `decode_step` (wise_jax.serving) and the engine around them,
`LLM` with `SamplingParams` / `RequestOutput` (wise_jax.engine), on which `generate` runs.
Several devices: `mesh=make_mesh(n)` (wise_jax.sharding) to LLM, generate, teacher_force and the
serving functions shards the heads, the paged K/V and the WISE supports over them.
"""

from wise_jax.checkpoint import restore_params, save_params
from wise_jax.engine import LLM, EngineStats, RequestOutput, SamplingParams
from wise_jax.generation import (ForcedOutput, GenerationOutput, GenerationStats, generate, teacher_force,
                                 trace_counts)
from wise_jax.loading import from_checkpoint_tensors, load_model, load_tokenizer
from wise_jax.model import forward, forward_with_exits
from wise_jax.params import LayerParams, Params, abstract_params, init_params, to_checkpoint_tensors
from wise_jax.scoring import Decoded, greedy, score
from wise_jax.serving import RequestKV, decode_step, insert, prefill
from wise_jax.sharding import make_mesh

__all__ = [
    "Decoded", "EngineStats", "ForcedOutput", "GenerationOutput", "GenerationStats", "LLM", "LayerParams", "Params",
    "RequestKV", "RequestOutput", "SamplingParams", "abstract_params", "decode_step", "forward",
    "forward_with_exits", "from_checkpoint_tensors", "generate", "greedy", "init_params", "insert", "load_model", "make_mesh",
    "load_tokenizer", "prefill", "restore_params", "save_params", "score", "teacher_force", "to_checkpoint_tensors",
    "trace_counts",
]
