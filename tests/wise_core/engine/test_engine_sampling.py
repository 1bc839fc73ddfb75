"""SamplingParams' logits processing and logprobs at both engines (wise_torch.LLM, wise_jax.LLM),
each test run once per framework: repetition / presence / frequency penalties, logit_bias and
min_tokens against a numpy recomputation from the engine's own raw logits (kept per step), top-k
logprobs against an independent log_softmax, bad values refused. CPU, fp32, random weights."""

import dataclasses

import numpy as np
import pytest

from wise_core.checkpoint import random_tensors
from wise_core.detokenize import TextStream
from wise_core.presets import PRESETS
from wise_core.sampling_params import MAX_LOGPROBS, SamplingParams

EOS = 17
CONFIG = dataclasses.replace(PRESETS["test-tiny"], eos_token_id=EOS)
PROMPTS = [[5, 9, 2, 7, 1, 3, 9, 9], [4, 4, 8, 1]]
# Greedy tokens are compared with the argmax of logits processed in numpy: a few float32
# elementwise operations apart from the engine's (relative rounding ~1e-7 on logits of size ~1),
# so a position whose top two processed logits are this close could flip and is not compared.
TIE = 1e-4


def engine(framework: str, **kw):
    tensors = random_tensors(CONFIG, seed=3, std=0.08)
    kw = {"num_pages": 16, "page_size": 32, "max_model_len": 256, "attention_backend": "reference", **kw}
    if framework == "torch":
        import wise_torch
        return wise_torch.LLM(wise_torch.from_tensors(CONFIG, tensors), **kw)
    import wise_jax
    return wise_jax.LLM(wise_jax.from_checkpoint_tensors(CONFIG, tensors), CONFIG, max_num_seqs=4, **kw)


@pytest.fixture(scope="module", params=["torch", "jax"])
def llm(request):
    return engine(request.param)


def state_of(llm):
    """The engine's per-slot logits state (None until a request needs it)."""
    return llm.runner.sampler.logits_state if hasattr(llm, "runner") else llm.logits_state


def run(llm, params_list, prompts=PROMPTS):
    """Run the prompts together -> [(RequestOutput, raw logits float32[tokens, vocab])] in order."""
    ids = [llm.add_request(p, sp, keep_logits=True) for p, sp in zip(prompts, params_list)]
    seqs = [llm.sequences[r] for r in ids]
    outs = llm.run_until_done(ids)
    return [(o, np.stack([np.asarray(x, np.float32) for x in s.logits])) for o, s in zip(outs, seqs)]


def tokens(llm, params, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def processed(raw, prompt, before, p: SamplingParams):
    """SamplingParams' processing of one position's raw logits float32[vocab] in numpy, given
    the tokens generated before it (the order the engines document)."""
    vocab = raw.shape[0]
    z = raw.copy()
    for t, b in (p.logit_bias or {}).items():
        z[t] += np.float32(b)
    if len(before) < p.min_tokens:
        z[list(p.stop_token_ids) + ([] if p.ignore_eos else [EOS])] = -np.inf
    counts = np.bincount(np.asarray(before, np.int64), minlength=vocab).astype(np.float32)
    seen = counts > 0
    seen[prompt] = True
    r = np.float32(p.repetition_penalty)
    z = np.where(seen, np.where(z > 0, z / r, z * r), z)
    return z - np.float32(p.frequency_penalty) * counts - np.float32(p.presence_penalty) * (counts > 0)


def assert_greedy_of_processed(out, raw, prompt, p) -> int:
    """Each greedy token is the argmax of its raw logits processed in numpy -> positions compared."""
    compared = 0
    for i, token in enumerate(out.token_ids):
        z = processed(raw[i], prompt, out.token_ids[:i], p)
        top2 = np.sort(z)[-2:]
        if top2[1] - top2[0] > TIE:
            assert token == int(np.argmax(z)), (i, token, int(np.argmax(z)))
            compared += 1
    return compared


def test_default_params_take_the_fast_path_and_neutral_processing_changes_nothing(llm):
    """Default requests never make the logits state; greedy tokens are the argmax of the raw
    logits; a request processed with neutral values (zero bias, penalties 1 / 0) gives the very
    tokens of default params, and a default request beside a processed one its solo tokens."""
    default = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = tokens(llm, default)
    if state_of(llm) is None:                 # the module's first test on this engine
        for (out, raw), prompt in zip(run(llm, [default] * 2), PROMPTS):
            assert out.token_ids == np.argmax(raw, -1).tolist()
        assert state_of(llm) is None
    neutral = dataclasses.replace(default, logit_bias={3: 0.0}, repetition_penalty=1.0)
    assert neutral.processed and tokens(llm, neutral) == plain
    assert state_of(llm) is not None
    penalized = dataclasses.replace(default, repetition_penalty=3.0)
    mixed = llm.generate(PROMPTS, [default, penalized], use_tqdm=False)
    assert mixed[0].token_ids == plain[0]
    assert mixed[1].token_ids == tokens(llm, penalized)[1]


def test_logit_bias(llm):
    """A bias of 100 makes greedy pick its token every step, -100 keeps the greedy token out;
    moderate biases give the argmax of raw logits + bias."""
    base = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = tokens(llm, base)
    assert tokens(llm, dataclasses.replace(base, logit_bias={200: 100.0})) == [[200] * 6] * 2
    banned = {plain[0][0]: -100.0, plain[1][0]: -100}
    for toks in tokens(llm, dataclasses.replace(base, logit_bias=banned)):
        assert not set(toks) & set(banned)
    p = dataclasses.replace(base, logit_bias={plain[0][1]: -0.5, 77: 0.3, 250: 0.45})
    results = run(llm, [p, p])
    assert sum(assert_greedy_of_processed(o, raw, prompt, p) for (o, raw), prompt in zip(results, PROMPTS)) >= 10
    assert [o.token_ids for o, _ in results] != plain          # the biases mattered


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.8), dict(repetition_penalty=0.6),
                                     dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
                                     dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=1.3)],
                         ids=["repetition", "repetition<1", "presence", "frequency", "all"])
def test_penalties_against_numpy(llm, penalty):
    """Greedy under each penalty is the argmax of the raw logits penalized in numpy over the
    prompt and the tokens before, and the penalty changes the output. The prompts end with
    their own greedy continuation, so the prompt's tokens compete from the first position."""
    base = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [p + t[:4] for p, t in zip(PROMPTS, tokens(llm, base))]
    p = dataclasses.replace(base, **penalty)
    results = run(llm, [p, p], prompts)
    compared = sum(assert_greedy_of_processed(o, raw, prompt, p) for (o, raw), prompt in zip(results, prompts))
    assert compared >= 20
    plain = tokens(llm, base, prompts)
    assert [o.token_ids for o, _ in results] != plain
    if penalty.get("repetition_penalty", 1) > 1:    # the prompt alone is penalized at the first position
        assert [o.token_ids[0] for o, _ in results] != [t[0] for t in plain]


def test_penalties_apply_before_sampling_filters(llm):
    """Sampling with top_k 1 keeps only the most probable processed token: the penalized greedy
    tokens, at any temperature and seed; seeded penalized sampling repeats."""
    p = SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=0.5,
                       logit_bias={9: 0.2})
    greedy = tokens(llm, p)
    assert tokens(llm, dataclasses.replace(p, temperature=1.3, top_k=1, seed=4)) == greedy
    free = dataclasses.replace(p, temperature=1.0, seed=11)
    assert tokens(llm, free) == tokens(llm, free)


def test_min_tokens_keeps_stop_ids_and_eos_out(llm):
    """With a bias making eos (or a stop id) the greedy token, the request ends at once; with
    min_tokens m it ends as the (m + 1)-th token, the stop ids masked before."""
    forced_eos = SamplingParams(max_tokens=10, logit_bias={EOS: 100.0})
    assert tokens(llm, forced_eos) == [[EOS]] * 2
    for m in (1, 4):
        for out in llm.generate(PROMPTS, dataclasses.replace(forced_eos, min_tokens=m), use_tqdm=False):
            assert len(out.token_ids) == m + 1 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
            assert (out.finish_reason, out.stop_reason) == ("stop", None)
    stop = SamplingParams(max_tokens=10, logit_bias={40: 100.0}, stop_token_ids=[40, 41], min_tokens=3)
    results = run(llm, [stop, stop])
    for (out, raw), prompt in zip(results, PROMPTS):
        assert out.token_ids[-1] == 40 and len(out.token_ids) == 4 and out.stop_reason == 40
        assert 41 not in out.token_ids and EOS not in out.token_ids
        assert assert_greedy_of_processed(out, raw, prompt, stop) >= 3
    # ignore_eos: eos is not a stop id, min_tokens does not mask it
    assert tokens(llm, dataclasses.replace(forced_eos, ignore_eos=True, min_tokens=3, max_tokens=5)) == [[EOS] * 5] * 2


def test_top_logprobs_against_log_softmax(llm):
    """logprobs=k: per position the chosen token (its log p and rank) then the k most probable,
    as an independent float64 log_softmax of the raw logits gives them; RequestOutput.logprobs
    stays the chosen tokens' log p. logprobs True is 0, False None."""
    k = 5
    p = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=2, logprobs=k, repetition_penalty=1.2)
    for out, raw in run(llm, [p, p]):
        logp = raw.astype(np.float64) - np.log(np.exp(raw.astype(np.float64)).sum(-1, keepdims=True))
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(out.token_ids) == len(out.logprobs) == 6
        for i, (token, entry) in enumerate(zip(out.token_ids, completion.logprobs)):
            order = np.argsort(-logp[i], kind="stable")
            ids = list(entry)
            assert ids[0] == token and entry[token].logprob == out.logprobs[i]
            assert entry[token].rank == int((logp[i] >= logp[i, token]).sum())
            want = [t for t in order[:k].tolist() if t != token]
            assert ids[1:] == want
            for t in want:
                assert entry[t].rank == order.tolist().index(t) + 1 and entry[t].decoded_token is None
            for t in ids:   # fp32 log_softmax over 384 logits against float64
                assert abs(entry[t].logprob - logp[i, t]) < 1e-5
    assert SamplingParams(logprobs=True).logprobs == 0 and SamplingParams(logprobs=False).logprobs is None
    [zero] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, logprobs=True, ignore_eos=True), use_tqdm=False)
    assert [list(e) for e in zero.outputs[0].logprobs] == [[t] for t in zero.token_ids]
    assert [e[t].logprob for e, t in zip(zero.outputs[0].logprobs, zero.token_ids)] == zero.logprobs
    [none] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3), use_tqdm=False)
    assert none.logprobs is None and none.outputs[0].logprobs is None


def test_bad_values_are_refused(llm):
    for bad, match in ((dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
                       (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
                       (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
                       (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
                       (dict(frequency_penalty="1"), "frequency_penalty must be a finite number"),
                       (dict(logit_bias={1: 100.5}), r"biases in \[-100, 100\]"),
                       (dict(logit_bias={1: float("nan")}), "logit_bias must be a dict"),
                       (dict(logit_bias={-1: 1.0}), "logit_bias must be a dict"),
                       (dict(logit_bias={1.0: 1.0}), "logit_bias must be a dict"),
                       (dict(logit_bias=[(1, 1.0)]), "logit_bias must be a dict"),
                       (dict(min_tokens=-1), r"min_tokens must be an integer in \[0, max_tokens"),
                       (dict(min_tokens=17), r"min_tokens must be an integer in \[0, max_tokens \(16\)\]"),
                       (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be a bool"),
                       (dict(logprobs=MAX_LOGPROBS + 1), r"logprobs must be None or an integer in \[0, 20\]"),
                       (dict(logprobs=-1), "logprobs must be None or an integer"),
                       (dict(logprobs=1.0), "logprobs must be None or an integer"),
                       (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs must be None or an integer")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match=r"logit_bias names token ids \[384\] outside the vocabulary \(size 384\)"):
        llm.add_request(PROMPTS[0], SamplingParams(logit_bias={3: 1.0, CONFIG.vocab_size: 1.0}))
    assert not llm.has_unfinished()
    s = llm.stats()
    assert s.waiting == s.running == 0 and s.free_pages == s.total_pages


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_processed_requests_preempted_resume_with_their_tokens(framework):
    """Too few pages for both requests: one is preempted and resumes (its logits state rebuilt
    from its tokens, maybe in another slot), giving the tokens it gets alone."""
    p = SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.5, presence_penalty=0.5,
                       logit_bias={11: 0.3})
    small = engine(framework, num_pages=3, max_model_len=64)
    together = tokens(small, p)
    assert small.stats().preemptions > 0
    roomy = engine(framework, max_model_len=64)
    alone = [tokens(roomy, p, [prompt])[0] for prompt in PROMPTS]
    assert together == alone


def test_jax_does_not_recompile_per_value():
    llm = engine("jax")
    from wise_jax.serving import TRACES
    base = SamplingParams(max_tokens=5, ignore_eos=True, repetition_penalty=1.5, logit_bias={4: 1.0}, min_tokens=2,
                          logprobs=2)
    tokens(llm, base)
    traces = dict(TRACES)
    for other in (dict(repetition_penalty=0.7, presence_penalty=0.3), dict(frequency_penalty=-1.0, logprobs=5),
                  dict(logit_bias={9: -3.0, 10: 2.0}, min_tokens=4)):
        tokens(llm, dataclasses.replace(base, **other))
    assert dict(TRACES) == traces


def test_speculation_refuses_processing():
    import wise_torch
    from wise_core.speculative_config import SpeculativeConfig
    llm = wise_torch.LLM(wise_torch.from_tensors(CONFIG, random_tensors(CONFIG, seed=3, std=0.08)), num_pages=16,
                         page_size=32, max_model_len=256, speculative_config=SpeculativeConfig(num_draft=2))
    for params in (dict(repetition_penalty=1.1), dict(presence_penalty=0.1), dict(logit_bias={1: 1.0}),
                   dict(min_tokens=1), dict(logprobs=1)):
        with pytest.raises(ValueError, match="speculative decoding does not apply"):
            llm.add_request(PROMPTS[0], SamplingParams(**params))
    [out] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert [list(e) for e in out.outputs[0].logprobs] == [[t] for t in out.token_ids]
    assert [e[t].logprob for e, t in zip(out.outputs[0].logprobs, out.token_ids)] == out.logprobs
    assert all(e[t].rank >= 1 for e, t in zip(out.outputs[0].logprobs, out.token_ids))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_stop_strings_with_min_tokens_and_include_stop_str(framework):
    """include_stop_str_in_output keeps the stop string in the text; with min_tokens past the
    token that completed it, that occurrence does not stop the request."""
    if framework == "torch":
        import wise_torch
        llm = wise_torch.LLM("ouro-py-3m", num_pages=8, max_model_len=128)
    else:
        import wise_jax
        llm = wise_jax.LLM("ouro-py-3m", num_pages=8, max_model_len=128, max_num_seqs=2)
    base = SamplingParams(max_tokens=16, ignore_eos=True)
    [full] = llm.generate("def add(a, b):", base, use_tqdm=False)
    stop = full.text[4:6]
    at = full.text.find(stop)
    [kept] = llm.generate("def add(a, b):", dataclasses.replace(base, stop=[stop], include_stop_str_in_output=True),
                          use_tqdm=False)
    assert kept.text == full.text[:at + len(stop)] and kept.stop_reason == stop
    n = len(kept.token_ids)
    [late] = llm.generate("def add(a, b):", dataclasses.replace(base, stop=[stop], min_tokens=n + 1), use_tqdm=False)
    assert len(late.token_ids) > n and late.token_ids[:n] == kept.token_ids
    assert len(late.text) > at              # not cut at the first occurrence (a later one may end it)


class Chars:
    """A tokenizer of one character per id (ord)."""

    @staticmethod
    def decode(ids):
        return "".join(map(chr, ids))


def test_text_stream_min_tokens_and_include_stop():
    text = [ord(c) for c in "ab.cd.ef"]
    for min_tokens, include, want in ((0, False, "ab"), (0, True, "ab."), (3, False, "ab"), (4, False, "ab.cd"),
                                      (4, True, "ab.cd."), (7, False, "ab.cd.ef")):
        stream = TextStream(Chars(), (".",), min_tokens=min_tokens, include_stop=include)
        stream.add(text)
        stream.finish()
        assert stream.text == want, (min_tokens, include)
        assert stream.stopped == (want != "ab.cd.ef")
