"""wise_jax.serving and wise_jax.engine: staggered admissions give each request the tokens
`generate` gives it alone (dense and WISE), slot reuse and abort, pool accounting, one compiled
step per engine shape, a step short of pages that writes nothing and is reported, and bad requests. fp32,
reference kernel."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_jax import kv_cache as kvc
from wise_jax import wise_state as ws
from wise_jax.engine import LLM, SamplingParams

CONFIG = PRESETS["test-tiny-gqa"]
PAGE = 32
# Lengths within one page count (3 pages with their new tokens), so every `generate` alone shares one
# compiled engine; max_tokens differ, so requests finish at different steps.
PROMPTS = [(70, 9), (75, 4), (66, 7), (72, 5)]


@pytest.fixture(scope="module")
def params():
    return wise_jax.from_checkpoint_tensors(CONFIG, random_tensors(CONFIG, seed=2, std=0.08))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [(rng.integers(0, CONFIG.vocab_size, n).tolist(), new) for n, new in PROMPTS]


@pytest.mark.parametrize("wise_config", [None, WiseConfig(eta=0.5)], ids=["dense", "wise"])
def test_staggered_admissions_match_generate_alone(params, prompts, wise_config):
    """Two slots for four requests: two join at once, a third while they run, the fourth when a
    slot frees (a reused slot, whose WISE support must not leak); one request is aborted."""
    llm = LLM(params, CONFIG, wise_config=wise_config, page_size=PAGE, max_num_seqs=2, max_model_len=3 * PAGE,
              num_pages=6)
    greedy = [SamplingParams(max_tokens=new, ignore_eos=True) for _, new in prompts]
    jax.clear_caches()      # the steps this engine compiles, whatever ran before in the process
    before = wise_jax.trace_counts()
    final = {}

    def step():
        for out in llm.step():
            if out.finished:
                final[out.request_id] = out

    ids = [llm.add_request(prompts[0][0], greedy[0]), llm.add_request(prompts[1][0], greedy[1])]
    assert llm.step() == []                                      # both prefill; their tokens are read a step later
    first = llm.step()
    assert [(o.request_id, len(o.token_ids)) for o in first] == [(ids[0], 1), (ids[1], 1)]
    step()
    ids.append(llm.add_request(prompts[2][0], greedy[2]))
    for _ in range(3):
        step()                                                   # request 1 (4 tokens) ends; 2 takes its slot
    ids.append(llm.add_request(prompts[3][0], greedy[3]))
    step()
    aborted = llm.add_request(prompts[3][0], greedy[3])           # waits, then leaves
    out = llm.abort(aborted)
    assert out.finish_reason == "abort" and out.finished and out.token_ids == []
    while llm.has_unfinished():
        step()
    for call in (llm.abort, llm.output):                         # finished requests leave the engine
        with pytest.raises(KeyError, match="no unfinished request"):
            call(aborted)
    stats = llm.stats()     # one compilation per step shape (batch bucket 1 or 2, context bucket), no more
    assert wise_jax.trace_counts()["step"] - before.get("step", 0) == stats.step_programs
    assert 2 <= stats.step_programs <= stats.step_program_bound

    for rid, (prompt, new) in zip(ids, prompts):
        out = final[rid]
        alone = wise_jax.generate(params, CONFIG, [prompt], max_new_tokens=new, eos_token_id=None,
                                  wise_config=wise_config, page_size=PAGE)
        assert out.token_ids == alone.tokens[0], rid
        assert out.finished and out.finish_reason == "length" and out.prompt_token_ids == prompt
    stats = llm.stats()
    assert (stats.free_pages, stats.total_pages, stats.running, stats.waiting) == (6, 6, 0, 0)
    # Every token after a request's first is decoded; those of steps that also prefill count
    # with prefill time (wise_core.engine.LLMEngine.step), the rest as decode tokens.
    assert 0 < stats.decode_tokens < sum(new for _, new in prompts) - len(prompts)
    assert stats.generated_tokens == sum(new for _, new in prompts)
    assert stats.prompt_tokens == sum(len(p) for p, _ in prompts)
    if wise_config is not None:
        assert stats.fallbacks == 0 and all(0 < d < 1 for d in stats.density.values()), stats.density


def test_full_pool_step_writes_nothing(params):
    """A decode step whose new page does not fit changes no K/V, length or WISE state; the flag is set."""
    wise_config = WiseConfig()
    cache = kvc.create(CONFIG, batch=2, max_pages=2, num_pages=1, page_size=PAGE)
    logits, kv = wise_jax.prefill(params, CONFIG, list(range(1, PAGE + 1)), page_size=PAGE)   # one full page
    cache = wise_jax.insert(cache, kv, 0)
    state = ws.create(wise_config, slots=2, layers=CONFIG.num_hidden_layers, heads=CONFIG.num_attention_heads,
                      max_blocks=2 * PAGE // wise_config.block_size)
    held = jax.tree.map(np.asarray, (cache, state))
    _, cache, state = wise_jax.decode_step(params, CONFIG, cache, state, jnp.asarray([5, 0], jnp.int32),
                                           jnp.asarray([0, -1], jnp.int32), wise_config=wise_config,
                                           kernel="reference")
    assert bool(cache.overflowed)
    for name in ("k", "v"):                                      # every page but the scratch page
        np.testing.assert_array_equal(np.asarray(getattr(cache, name))[:, :1], getattr(held[0], name)[:, :1])
    for name in ("seq_lens", "page_table", "num_free"):
        np.testing.assert_array_equal(np.asarray(getattr(cache, name)), getattr(held[0], name), err_msg=name)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(held[1])):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_bad_requests_are_named_errors(params, prompts):
    llm = LLM(params, CONFIG, page_size=PAGE, max_num_seqs=2, max_model_len=3 * PAGE, num_pages=2)
    prompt = prompts[0][0]
    with pytest.raises(ValueError, match=r"70 prompt \+ 40 new tokens, more than max_model_len \(96\)"):
        llm.add_request(prompt, SamplingParams(max_tokens=40))
    with pytest.raises(ValueError, match="needs 3 pages of 32 tokens, more than the pool's 2"):
        llm.add_request(prompt, SamplingParams(max_tokens=10))
    with pytest.raises(KeyError, match="no unfinished request 7"):
        llm.abort(7)
    with pytest.raises(ValueError, match="forced continuation holds token ids"):
        llm.add_request(prompt, forced=[1, CONFIG.vocab_size])
    with pytest.raises(TypeError, match="integer token ids"):
        llm.add_request([1.5, 2])
    with pytest.raises(ValueError, match="a string but the engine has no tokenizer"):
        llm.add_request("text")
    for kwargs, match in (({"max_tokens": 0}, "max_tokens"), ({"temperature": "0.5"}, "temperature"),
                          ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"seed": 2 ** 70}, "seed"), ({"ignore_eos": "no"}, "ignore_eos"),
                          ({"stop_token_ids": [1.5]}, "stop_token_ids")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="page_size must be a multiple of the block_size 32, got 48"):
        LLM(params, CONFIG, page_size=48)
    cache = kvc.create(CONFIG, batch=2, max_pages=3, num_pages=6, page_size=PAGE)
    _, kv = wise_jax.prefill(params, CONFIG, prompt, page_size=PAGE)
    cache = wise_jax.insert(cache, kv, 1)
    with pytest.raises(ValueError, match="slot 1 holds a request"):
        wise_jax.insert(cache, kv, 1)
    with pytest.raises(ValueError, match=r"slot must be an integer in \[0, 2\)"):
        wise_jax.insert(cache, kv, 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        wise_jax.prefill(params, CONFIG, [CONFIG.vocab_size], page_size=PAGE)
    too_long = dataclasses.replace(CONFIG, max_position_embeddings=50)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        wise_jax.prefill(params, too_long, prompt, page_size=PAGE)


def test_llm_takes_a_model_by_name_with_its_tokenizer():
    """LLM("ouro-py-3m") as wise_torch.LLM takes it: config, weights (float32 on a CPU) and the
    checkpoint's tokenizer, so string prompts work; a config beside a name is an error."""
    config, params, tokenizer = wise_jax.load_model("ouro-py-3m", with_tokenizer=True)
    llm = LLM("ouro-py-3m", max_num_seqs=2, max_model_len=128, num_pages=8)
    assert llm.config == config and llm.tokenizer is not None
    assert llm.params.embed_tokens.dtype == jnp.float32
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=6), use_tqdm=False)[0]
    want = LLM(params, config, tokenizer=tokenizer, max_num_seqs=2, max_model_len=128, num_pages=8).generate(
        ["def add(a, b):"], SamplingParams(max_tokens=6), use_tqdm=False)[0]
    assert out.token_ids == want.token_ids and out.text == want.text and out.text
    with pytest.raises(ValueError, match="config comes from the checkpoint"):
        LLM("ouro-py-3m", config)
    with pytest.raises(ValueError, match="dtype applies to a model loaded by name"):
        LLM(params, config, dtype=jnp.bfloat16)
