"""How the engine decode benchmarks time a cohort and what bounds it: the step loop
(`run_cohort`), the engine's counters (`reset_counters`, `stats_dict`), and the bandwidth roofline
of a decode step (`roofline`: the weights and K/V bytes a step reads over --hbm-tbps)."""

from __future__ import annotations

import dataclasses
import json
import math
import time

HBM_TBPS = 4.3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# What a decode step reads of each architecture's weights, by HF tensor-name prefix: once per loop
# (Ouro) or core iteration (Huginn), and once per step; and the embedding (the tied head).
STEP_WEIGHTS = {
    "ouro": dict(per_depth=("model.layers.", "model.norm.", "model.early_exit_gate."), once=(),
                 embedding="model.embed_tokens.weight"),
    "huginn": dict(per_depth=("transformer.core_block.", "transformer.adapter."),
                   once=("transformer.prelude.", "transformer.coda.", "transformer.ln_f."),
                   embedding="transformer.wte.weight"),
}


def weight_bytes_per_step(config, dtype: str, batch: int, num_steps: int | None = None) -> int:
    """Weight bytes one decode step of `num_steps` depths (None: the config's total_ut_steps)
    reads (HF checkpoint shapes, `STEP_WEIGHTS`): Ouro's layers, final norm and exit gate once per
    loop; Huginn's prelude, coda and ln_f once, its core block and adapter once per core
    iteration; the LM head once; the batch's embedding rows."""
    from wise_core.checkpoint import expected_shapes
    shapes, parts = expected_shapes(config), STEP_WEIGHTS[config.architecture]
    steps = config.num_loops if num_steps is None else num_steps
    per_depth = sum(math.prod(s) for name, s in shapes.items() if name.startswith(parts["per_depth"]))
    once = sum(math.prod(s) for name, s in shapes.items() if parts["once"] and name.startswith(parts["once"]))
    head = math.prod(shapes[parts["embedding"] if config.tie_word_embeddings else "lm_head.weight"])
    return (steps * per_depth + once + head + batch * config.hidden_size) * DTYPE_BYTES[dtype]


def kv_bytes_per_step(config, dtype: str, batch: int, context: float, density: dict | None,
                      num_steps: int | None = None) -> float:
    """K and V bytes one decode step of `num_steps` depths (None: total_ut_steps) reads at
    `context` keys per request: every plane (Ouro: one per (loop, layer); Huginn: `num_planes`,
    the prelude's and coda's, dense, and one per (core iteration, core layer)), reuse depths'
    planes at their support density (density: {depth: fraction} or None = dense)."""
    steps = config.num_loops if num_steps is None else num_steps
    per_token = 2 * config.num_key_value_heads * config.head_dim * DTYPE_BYTES[dtype]
    depth_planes = sum((density or {}).get(depth, 1.0) for depth in range(steps)) * config.loop_layers
    if config.architecture == "huginn":
        from wise_core.huginn_reference import num_planes
        depth_planes += num_planes(config, steps) - steps * config.loop_layers   # the prelude's and coda's
    return depth_planes * batch * context * per_token


def roofline(config, dtype: str, context: int, batch: int, new_tokens: int, density: dict | None,
             hbm_tbps: float, num_steps: int | None = None) -> dict:
    """Bandwidth roofline of one decode step of the cohort (`num_steps` depths, None: the config's
    total_ut_steps): ms/step and tok/s."""
    mean_context = context + new_tokens / 2
    total = (weight_bytes_per_step(config, dtype, batch, num_steps)
             + kv_bytes_per_step(config, dtype, batch, mean_context, density, num_steps))
    seconds = total / (hbm_tbps * 1e12)
    return dict(bytes=total, ms_per_step=1e3 * seconds, tokens_per_s=batch / seconds)


def run_cohort(llm, prompts: list[list[int]], params, max_tokens: int, clock=time.perf_counter) -> dict:
    """Add the cohort, step until every request finished; time the steps after the one in which
    the whole cohort has its first token. Checks every request ends with exactly max_tokens;
    returns the requests' tokens too."""
    start = clock()
    ids = [llm.add_request(p, params) for p in prompts]
    lengths = dict.fromkeys(ids, 0)
    tokens_of = dict.fromkeys(ids)
    started = None
    tokens_at_start = steps = 0
    end = start
    while llm.has_unfinished():
        outputs = llm.step()
        end = clock()
        for out in outputs:
            if out.request_id in lengths:
                lengths[out.request_id] = len(out.token_ids)
                tokens_of[out.request_id] = list(out.token_ids)
        if started is not None:
            steps += 1
        elif all(lengths.values()):
            started, tokens_at_start = end, sum(lengths.values())
    wrong = {rid: n for rid, n in lengths.items() if n != max_tokens}
    if wrong:
        raise RuntimeError(f"requests ended with token counts {wrong}, expected {max_tokens} each (ignore_eos)")
    if started is None or steps == 0:
        raise RuntimeError("no decode step ran after the whole cohort had its first token")
    decode_s = end - started
    tokens = sum(lengths.values()) - tokens_at_start
    return dict(prefill_s=started - start, decode_s=decode_s, decode_tokens=tokens, decode_steps=steps,
                decode_tokens_per_s=tokens / decode_s, ms_per_step=1e3 * decode_s / steps,
                tokens=[tokens_of[rid] for rid in ids])


def reset_counters(llm) -> bool:
    """Zero the engine's counters, which LLM.stats() reports since the engine started, so a
    cohort's stats are its own: `LLM.reset_stats` (WISE density and fallbacks on every
    tensor-parallel rank, the mean decode depth, the step counters), or, on an engine without it,
    the WISE counters alone; False where the engine has neither hook."""
    if hasattr(llm, "reset_stats"):
        llm.reset_stats()
        return True
    runner = getattr(llm, "runner", None)
    wise = getattr(runner, "wise", None)
    if wise is None or not hasattr(wise, "reset_counters"):
        return False
    (runner.reset_wise_counters if hasattr(runner, "reset_wise_counters") else wise.reset_counters)()
    return True


def stats_dict(stats) -> dict:
    """LLM.stats() as a JSON-able dict."""
    if dataclasses.is_dataclass(stats):
        raw = dataclasses.asdict(stats)
    elif isinstance(stats, dict):
        raw = dict(stats)
    else:
        raw = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    return json.loads(json.dumps(raw, default=str))
