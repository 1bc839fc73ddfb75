"""Bad inputs and edge values at both engines (wise_torch.LLM, wise_jax.LLM), one test per case
run once per framework: each is a clear error naming the problem, or the correct result, and
nothing is left queued or held."""

import dataclasses

import numpy as np
import pytest

from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams

CONFIG = PRESETS["test-tiny"]
PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 1]]


def tensors(nan: bool = False) -> dict:
    t = random_tensors(CONFIG, seed=3, std=0.08)
    if nan:
        t["model.norm.weight"] = np.full_like(t["model.norm.weight"], np.nan)   # every logit NaN
    return t


def engine(framework: str, nan: bool = False, config=CONFIG, **kw):
    if framework == "torch":
        import wise_torch
        return wise_torch.LLM(wise_torch.from_tensors(config, tensors(nan)), num_pages=16, page_size=32, **kw)
    import wise_jax
    return wise_jax.LLM(wise_jax.from_checkpoint_tensors(config, tensors(nan)), config, num_pages=16, page_size=32,
                        max_num_seqs=4, **kw)


FRAMEWORKS = ["torch", "jax"]


@pytest.fixture(scope="module", params=FRAMEWORKS)
def llm(request):
    return engine(request.param, max_model_len=256)


def tokens(llm, params):
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_numpy_numbers_are_plain_python_in_sampling_params(llm):
    """A numpy seed (or max_tokens, temperature) passes the checks and reaches the engine as a
    Python number: generation runs, and gives what the Python values give."""
    p = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.8), seed=np.int64(7), ignore_eos=True)
    assert type(p.seed) is int and type(p.max_tokens) is int and type(p.temperature) is float
    want = tokens(llm, SamplingParams(max_tokens=5, temperature=float(np.float32(0.8)), seed=7, ignore_eos=True))
    assert tokens(llm, p) == want and all(len(t) == 5 for t in want)
    assert not llm.has_unfinished()


def test_a_temperature_that_underflows_float32_is_greedy(llm):
    greedy = tokens(llm, SamplingParams(max_tokens=6, ignore_eos=True))
    for tiny in (1e-50, 1e-300):       # positive and finite in Python, 0 in float32
        for top_p in (1.0, 0.9):
            assert tokens(llm, SamplingParams(max_tokens=6, temperature=tiny, top_p=top_p, seed=1,
                                              ignore_eos=True)) == greedy


def test_run_until_done_refuses_an_id_that_would_never_finish(llm):
    done = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    for rid in (done.request_id, 10 ** 6):
        with pytest.raises(KeyError, match=f"no unfinished request {rid}"):
            llm.run_until_done([rid])


def test_generate_with_a_bad_later_prompt_queues_nothing(llm):
    with pytest.raises((ValueError, TypeError)):
        llm.generate([PROMPTS[0], [1, CONFIG.vocab_size + 5]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.has_unfinished() and llm.stats().waiting == 0
    assert llm.stats().free_pages == llm.stats().total_pages


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_engine_seed_and_max_model_len_are_checked(framework):
    for seed, error, match in ((-1, ValueError, r"seed must be in \[0, 2\*\*63\)"),
                               (2 ** 64, ValueError, r"seed must be in \[0, 2\*\*63\)"),
                               (1.5, TypeError, "seed must be an int or None")):
        with pytest.raises(error, match=match):
            engine(framework, seed=seed)
    with pytest.raises(ValueError, match=r"max_model_len 2048 exceeds the model's max_position_embeddings \(1024\)"):
        engine(framework, max_model_len=2048)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_nan_logits_are_an_error_not_a_token(framework):
    llm = engine(framework, nan=True, max_model_len=256)
    [out] = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    assert (out.finish_reason, out.token_ids, out.error) == ("error", [], "the model's logits are NaN for request 0")
    assert llm.stats().free_pages == llm.stats().total_pages
    while llm.has_unfinished():            # the step launched before the NaN was read: its row is dropped
        assert llm.step() == []


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_huge_max_position_embeddings_costs_only_what_max_model_len_needs(framework):
    """2**24 positions in the config (a RoPE table of them would be 8 GiB in torch): the model
    loads, and with max_model_len 256 gives the tokens of the same weights under a config of
    1,024 positions."""
    huge = dataclasses.replace(CONFIG, max_position_embeddings=2 ** 24)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = tokens(engine(framework, max_model_len=256), params)
    assert tokens(engine(framework, config=huge, max_model_len=256), params) == want


def test_vllm_shaped_outputs_and_single_prompts(llm):
    """generate takes one string or one token-id list as vLLM's does; each output has vLLM's
    `outputs[0]` (text, token_ids, finish_reason, stop_reason) beside today's fields."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True)
    [one] = llm.generate(PROMPTS[0], params, use_tqdm=False)
    [same] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert one.token_ids == same.token_ids and one.prompt_token_ids == PROMPTS[0]
    [completion] = one.outputs
    assert (completion.index, completion.token_ids, completion.finish_reason, completion.stop_reason) == (
        0, one.token_ids, "length", None)
    assert [e[t].logprob for e, t in zip(completion.logprobs, one.token_ids)] == one.logprobs
    assert [list(e) for e in completion.logprobs] == [[t] for t in one.token_ids] and len(one.logprobs) == 4
    assert llm.get_tokenizer() is None and one.prompt is None and completion.text is None
    stop = one.token_ids[1]
    [stopped] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=[stop]),
                             use_tqdm=False)
    cut = one.token_ids[:one.token_ids.index(stop) + 1]
    assert stopped.token_ids == cut and stopped.outputs[0].stop_reason == stop == stopped.stop_reason
    assert stopped.finish_reason == "stop"
    with pytest.raises(TypeError, match="a string, a token-id list, or a non-empty list of them"):
        llm.generate(np.asarray(PROMPTS[0]), params, use_tqdm=False)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_string_prompt_and_its_text_through_the_model_tokenizer(framework):
    if framework == "torch":
        import wise_torch
        llm = wise_torch.LLM("ouro-py-3m", num_pages=8, max_model_len=128)
    else:
        import wise_jax
        llm = wise_jax.LLM("ouro-py-3m", num_pages=8, max_model_len=128, max_num_seqs=2)
    [out] = llm.generate("def add(a, b):", SamplingParams(max_tokens=5), use_tqdm=False)
    assert out.prompt == "def add(a, b):" and out.outputs[0].text == out.text
    assert out.text == llm.get_tokenizer().decode(out.token_ids)


def test_top_k_and_min_p_sample_within_their_tokens(llm):
    """vLLM's top_k and min_p: top_k 1 or min_p 1 leave only the most probable token, so sampling
    at any temperature gives the greedy tokens; -1 means every token, as 0."""
    greedy = tokens(llm, SamplingParams(max_tokens=6, ignore_eos=True))
    for filters in (dict(top_k=1), dict(min_p=1.0), dict(top_k=1, min_p=0.5, top_p=0.5)):
        assert tokens(llm, SamplingParams(max_tokens=6, temperature=1.5, seed=3, ignore_eos=True,
                                          **filters)) == greedy, filters
    free = SamplingParams(max_tokens=6, temperature=1.5, seed=3, ignore_eos=True)
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    assert tokens(llm, dataclasses.replace(free, top_k=-1)) == tokens(llm, free)
    for bad, match in ((dict(top_k=-2), "top_k must be an integer >= -1"), (dict(top_k=1.5), "top_k must be"),
                       (dict(min_p=1.5), r"min_p must be in \[0, 1\]"), (dict(min_p=-0.1), "min_p must be")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_stop_strings_end_the_text_before_them(framework):
    """SamplingParams.stop, as vLLM's: the text ends before the first stop string, token_ids at
    the token that completed it, stop_reason names it; without a tokenizer it is refused."""
    if framework == "torch":
        import wise_torch
        llm = wise_torch.LLM("ouro-py-3m", num_pages=8, max_model_len=128)
    else:
        import wise_jax
        llm = wise_jax.LLM("ouro-py-3m", num_pages=8, max_model_len=128, max_num_seqs=2)
    tokenizer = llm.get_tokenizer()
    prompt = "def add(a, b):"
    [full] = llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    stop = full.text[4:6]
    assert len(stop) == 2 and full.text.find(stop) >= 0, full.text
    [cut] = llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop, "\x00never"]),
                         use_tqdm=False)
    at = full.text.find(stop)
    assert cut.text == cut.outputs[0].text == full.text[:at]
    assert (cut.finish_reason, cut.stop_reason, cut.outputs[0].stop_reason) == ("stop", stop, stop)
    n = len(cut.token_ids)
    assert cut.token_ids == full.token_ids[:n] and stop in tokenizer.decode(cut.token_ids)
    assert stop not in tokenizer.decode(cut.token_ids[:-1])        # the last token completed it
    assert SamplingParams(stop="x").stop == ("x",)
    with pytest.raises(ValueError, match="SamplingParams.stop must be a non-empty string"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="SamplingParams.stop needs a tokenizer"):
        engine(framework, max_model_len=256).add_request(PROMPTS[0], SamplingParams(stop=["a"]))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_generate_functions_take_stop_strings(framework):
    """wise_torch.generate / wise_jax.generate(stop=...): the texts end before the stop string."""
    if framework == "torch":
        import wise_torch
        model = wise_torch.load_model("ouro-py-3m")

        def run(**kw):
            return wise_torch.generate(model, ["def add(a, b):"], max_new_tokens=16, eos_token_id=None, **kw)
    else:
        import wise_jax
        config, params, tokenizer = wise_jax.load_model("ouro-py-3m", with_tokenizer=True)

        def run(**kw):
            return wise_jax.generate(params, config, ["def add(a, b):"], max_new_tokens=16, eos_token_id=None,
                                     tokenizer=tokenizer, **kw)
    [text] = run().texts
    stop = text[4:6]
    out = run(stop=[stop])
    assert out.texts == [text[:text.find(stop)]] and len(out.tokens[0]) < 16
