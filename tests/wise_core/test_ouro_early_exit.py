"""Ouro's early exit (early_exit_threshold < 1): the exit rule against a transcription of the
released code's, the numpy reference's decode (first token = the released forward, later planes
= the exit loop's K/V), torch and JAX decode logits and engine tokens (staggered arrivals, dense
and all-blocks WISE) against the reference, and threshold 1.0 unchanged. fp32, reference kernel;
a tiny model whose gate is set so that tokens exit at different loops (0, 1 and 3 in the
generated ones)."""

import dataclasses

import numpy as np
import pytest
import torch

from wise_core import ouro_reference as R
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.config_error import ConfigError
from wise_core.model_config import ModelConfig
from wise_core.sampling_params import SamplingParams
from wise_core.wise_config import WiseConfig

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, rope_theta=10000.0, total_ut_steps=4,
                     max_position_embeddings=512, early_exit_threshold=0.6)
PROMPTS = [(12, 10), (40, 6), (70, 8)]    # (prompt length, new tokens); 70 > max_num_batched_tokens: chunked
PAGE = 32


def tensors_with_gate(bias: float = -0.5) -> dict[str, np.ndarray]:
    """Random weights; the gate a random direction of norm ~sqrt(hidden), so its logit on the
    normed state spreads over several units and tokens exit at different loops."""
    t = random_tensors(CONFIG, seed=4, std=0.12)
    gate = np.random.default_rng(7).normal(0, 1.0, (1, CONFIG.hidden_size))
    t["model.early_exit_gate.weight"] = gate.astype(np.float32)
    t["model.early_exit_gate.bias"] = np.array([bias], np.float32)
    return t


TENSORS = tensors_with_gate()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [(rng.integers(0, CONFIG.vocab_size, n).tolist(), new) for n, new in PROMPTS]


@pytest.fixture(scope="module")
def expected(prompts):
    """The reference's (tokens, exit loops, logits) per prompt."""
    return [R.generate(CONFIG, TENSORS, p, new) for p, new in prompts]


def released_exit_steps(lambdas: np.ndarray, threshold: float) -> np.ndarray:
    """The released OuroForCausalLM.forward's exit step (branch `exit_threshold is not None`),
    transcribed: lambdas float32[loops, n] -> int[n]."""
    gate_list = [torch.from_numpy(lam) for lam in lambdas]
    pdf_list, remaining_prob = [], torch.ones_like(gate_list[0])
    for idx, lambda_i in enumerate(gate_list):
        if idx < len(gate_list) - 1:
            p_i = lambda_i * remaining_prob
            remaining_prob = remaining_prob * (1.0 - lambda_i)
        else:
            p_i = remaining_prob
        pdf_list.append(p_i)
    cumulative_probs = torch.cumsum(torch.stack(pdf_list, dim=1), dim=1)
    threshold_mask = cumulative_probs >= threshold
    exit_steps = torch.argmax(threshold_mask.float(), dim=1)
    exit_steps[~threshold_mask.any(dim=1)] = len(gate_list) - 1
    return exit_steps.numpy()


def test_exit_loops_is_the_released_rule():
    rng = np.random.default_rng(0)
    lambdas = rng.uniform(0, 1, (4, 4000)).astype(np.float32)
    lambdas[:, :8] = [[0, 1, 0.5, 0.6, 0.2, 0.3, 0, 0.9]] * 4       # saturated and exact values too
    for threshold in (0.0, 0.25, 0.5, 0.6, 0.9, 0.999):
        got = R.exit_loops(lambdas, threshold)
        assert np.array_equal(got, released_exit_steps(lambdas, threshold)), threshold
        assert len(set(got.tolist())) == 4 or threshold == 0.0        # every loop occurs
    assert (R.exit_loops(lambdas, 0.0) == 0).all()
    # threshold 1.0 runs every loop (the project's rule); the released rule would stop at loop 0
    # where a saturated gate makes the float cumulative sum exactly 1.
    saturated = np.ones((4, 1), np.float32)
    assert R.exit_loops(saturated, 1.0).tolist() == [3] and released_exit_steps(saturated, 1.0).tolist() == [0]
    assert (R.exit_loops(lambdas, 1.0) == 3).all()


def test_reference_decode_is_the_released_forward_then_keeps_the_exit_loops_kv(prompts):
    """The first decoded token's logits are the released forward's over prompt + token (every loop
    runs, the head reads its exit loop); its planes past the exit loop hold the exit loop's K/V."""
    w = R.ouro_weights(CONFIG, TENSORS)
    layers = CONFIG.num_hidden_layers
    exits = set()
    for prompt, _ in prompts:
        for token in range(8):
            cache = R.OuroCache()
            R.prefill(CONFIG, w, prompt, cache)
            logits, loop = R.decode(CONFIG, w, token, cache)
            exits.add(loop)
            whole = R.OuroCache()
            h, states, lambdas = w["model.embed_tokens.weight"][prompt + [token]], [], []
            for each in range(CONFIG.total_ut_steps):
                h = R.run_loop(CONFIG, w, h, np.arange(len(prompt) + 1), whole, each)
                states.append(h[-1])
                lambdas.append(R.exit_gate(w, h[-1:]))
            released = released_exit_steps(np.stack(lambdas), CONFIG.early_exit_threshold)[0]
            assert loop == released
            # float64 over 8 sublayers of width <= 64: agreement to 1e-12 of the logit scale
            assert np.abs(logits - states[released] @ w["lm_head.weight"].T).max() <= 1e-12 * np.abs(logits).max()
            for later in range(loop + 1, CONFIG.total_ut_steps):
                for layer in range(layers):
                    for kv in range(2):
                        assert np.array_equal(cache.planes[later * layers + layer][kv][-1],
                                              cache.planes[loop * layers + layer][kv][-1])
    assert {0, 3} < exits       # early exits at more than one depth, and tokens that run every loop


def test_reference_tokens_depend_on_the_exit(prompts, expected):
    """The test model's tokens exit at several depths, and its tokens are not those of every loop."""
    depths = {d for _, ds, _ in expected for d in ds}
    assert {0, 3} < depths
    every_loop = dataclasses.replace(CONFIG, early_exit_threshold=1.0)
    assert any(R.generate(every_loop, TENSORS, p, new)[0] != tokens
               for (p, new), (tokens, _, _) in zip(prompts, expected))


def model_of(framework: str, config: ModelConfig, tensors):
    if framework == "torch":
        import wise_torch
        return wise_torch.from_tensors(config, tensors).float()
    import wise_jax
    return wise_jax.from_checkpoint_tensors(config, tensors)


def generate(framework: str, model, config: ModelConfig, prompt, new: int, wise_config=None):
    """The framework's `generate` of prompt alone: (tokens, logits float64[new, vocab])."""
    if framework == "torch":
        import wise_torch
        out = wise_torch.generate(model, [prompt], max_new_tokens=new, eos_token_id=None, page_size=PAGE,
                                  attention_backend="reference", wise_config=wise_config, return_logits=True)
    else:
        import wise_jax
        out = wise_jax.generate(model, config, [prompt], max_new_tokens=new, eos_token_id=None, page_size=PAGE,
                                attention_backend="reference", wise_config=wise_config, return_logits=True)
    return out.tokens[0], np.asarray(out.logits[0], np.float64)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_decode_logits_equal_the_reference(framework, prompts, expected):
    """Every prompt in torch; in JAX (a compile per engine shape) the first two, whose tokens exit
    at loops 0, 1 and 3 (the engine test below has the third's tokens)."""
    model = model_of(framework, CONFIG, TENSORS)
    count = len(prompts) if framework == "torch" else 2
    for (prompt, new), (tokens, _, logits) in zip(prompts[:count], expected):
        got_tokens, got = generate(framework, model, CONFIG, prompt, new)
        assert got_tokens == tokens
        # fp32 against float64: rounding.model_bound (8 sublayers, widths <= 70 keys)
        diff, bound = rounding.model_difference(got, logits, CONFIG, keys=len(prompt) + new)
        assert diff <= bound, (diff, bound)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_no_row_exiting_is_every_loop(framework, prompts):
    """A gate that never reaches the threshold (bias -40: lambda ~ 4e-18) runs the exit machinery
    with no row exiting: the logits of threshold 1.0, which has none; bitwise in torch (the same
    kernels, whose results are only selected), within rounding in JAX (XLA compiles the larger
    program with other fusions)."""
    closed = tensors_with_gate(bias=-40.0)
    every_loop = dataclasses.replace(CONFIG, early_exit_threshold=1.0)
    prompt, new = prompts[0][0], 4
    _, want = generate(framework, model_of(framework, every_loop, closed), every_loop, prompt, new)
    _, got = generate(framework, model_of(framework, CONFIG, closed), CONFIG, prompt, new)
    if framework == "torch":
        assert np.array_equal(got, want)
    else:   # fp32 against fp32: rounding.model_bound (8 sublayers, widths <= 22 keys)
        diff, bound = rounding.model_difference(got, want, CONFIG, keys=len(prompt) + new)
        assert diff <= bound, (diff, bound)


def test_threshold_one_makes_no_exit_state():
    """At threshold 1.0 neither framework makes an exit state (the gate is not evaluated in prefill
    or decode): the programs are those that ran every loop before early exit existed."""
    import jax.numpy as jnp

    import wise_jax
    import wise_torch
    every_loop = dataclasses.replace(CONFIG, early_exit_threshold=1.0)
    for config, exits in ((every_loop, False), (CONFIG, True)):
        assert (wise_jax.model.exits_for(config, jnp.zeros((3, CONFIG.hidden_size))) is not None) == exits
        torch_model = wise_torch.from_tensors(config, TENSORS)
        assert (torch_model.exit_state(3, keep_kv=True, device="cpu") is not None) == exits


def engine_of(framework: str, model, wise_config):
    args = dict(wise_config=wise_config, page_size=PAGE, max_num_seqs=2, max_model_len=4 * PAGE,
                max_num_batched_tokens=64, attention_backend="reference")
    if framework == "torch":
        import wise_torch
        return wise_torch.LLM(model, **args)
    import wise_jax
    return wise_jax.LLM(model, CONFIG, **args)


@pytest.mark.parametrize("framework, wise_config", [("torch", None), ("torch", WiseConfig(all_blocks=True)),
                                                   ("jax", WiseConfig(all_blocks=True))],
                         ids=["torch-dense", "torch-wise-all-blocks", "jax-wise-all-blocks"])
def test_engine_staggered_arrivals_equal_the_reference(framework, wise_config, prompts, expected):
    """Two slots for three requests: two join at once (one prompt chunked), the third when a slot
    frees; rows exit at different loops in the same steps. All-blocks WISE is dense (JAX: that
    program only, which runs the dense arithmetic, a compile per engine shape being slow)."""
    llm = engine_of(framework, model_of(framework, CONFIG, TENSORS), wise_config)
    greedy = [SamplingParams(max_tokens=new, ignore_eos=True) for _, new in prompts]
    final = {}

    def step():
        for out in llm.step():
            if out.finished:
                final[out.request_id] = out.token_ids

    ids = [llm.add_request(prompts[2][0], greedy[2]), llm.add_request(prompts[0][0], greedy[0])]
    for _ in range(3):
        step()
    ids.append(llm.add_request(prompts[1][0], greedy[1]))
    while llm.has_unfinished():
        step()
    assert [final[i] for i in ids] == [expected[2][0], expected[0][0], expected[1][0]]
    # every decode step's token ran its exit loop + 1 loops (the first token is the prefill's)
    decoded = [d + 1 for _, depths, _ in expected for d in depths[1:]]
    assert llm.stats().mean_decode_depth == pytest.approx(sum(decoded) / len(decoded), rel=1e-12)


@pytest.mark.parametrize("threshold", [-0.01, 1.0001, float("nan"), float("inf")])
def test_invalid_threshold_refused(threshold):
    with pytest.raises(ConfigError, match="early_exit_threshold"):
        dataclasses.replace(CONFIG, early_exit_threshold=threshold)


def test_speculative_decoding_refuses_early_exit():
    import wise_torch
    from wise_torch.engine.speculative import SpeculativeConfig
    with pytest.raises(ValueError, match="exits early"):
        wise_torch.LLM(model_of("torch", CONFIG, TENSORS), speculative_config=SpeculativeConfig(), page_size=PAGE)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_exited_rows_are_not_counted_by_wise(framework, prompts):
    """A gate that is open (bias +40: lambda 1) exits every token at loop 0, before WISE's reuse
    loops: they count no fallback and no density, and every decoded token ran one loop. The same
    engine with every loop running counts them (torch; all-blocks WISE, the program the engine
    test above compiled in JAX)."""
    open_gate = tensors_with_gate(bias=40.0)
    prompt, _ = prompts[0]
    configs = [(CONFIG, True)] + ([(dataclasses.replace(CONFIG, early_exit_threshold=1.0), False)]
                                  if framework == "torch" else [])
    for config, exits in configs:
        llm = engine_of(framework, model_of(framework, config, open_gate), WiseConfig(all_blocks=True))
        llm.run_until_done([llm.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))])
        stats = llm.stats()
        if exits:
            assert stats.fallbacks == 0 and set(stats.density.values()) == {None}
            assert stats.mean_decode_depth == 1.0
        else:
            assert all(d is not None for d in stats.density.values()) and stats.mean_decode_depth is None
