"""Lossless speculative decoding in wise_torch.LLM: greedy tokens equal dense decode, sampling
keeps the dense distribution, rejected drafts leave nothing behind, and it works with
continuous batching, preemption, aborts, stop tokens and logprobs.

CPU, fp32, reference kernels. The model is a small random one whose layers add little to the
residual stream (their output norms scaled by 0.1), so that a draft of fewer loops agrees with
the dense model often but not always: every test sees both acceptances and rejections."""

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

import wise_torch as wt
from wise_core.checkpoint import random_tensors
from wise_core.config_error import ConfigError
from wise_core.modes import DENSE, SPARSE
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_torch.model import SequenceContext
from cases import prompts_of

WISE = WiseConfig(eta=0.5)
SPECS = {"wise": (wt.SpeculativeConfig("wise", num_draft=3), WISE),
         "wise-sparse": (wt.SpeculativeConfig("wise", num_draft=3, sparse_discovery=True), WISE),
         "loops": (wt.SpeculativeConfig("loops", num_draft=3, draft_loops=2), None)}
KINDS = list(SPECS)


def damped_model(config, seed=0, std=0.08, head_scale=1.0, damp=0.1):
    tensors = random_tensors(config, seed=seed, std=std)
    for name in tensors:
        if name.endswith(("input_layernorm_2.weight", "post_attention_layernorm_2.weight")):
            tensors[name] = tensors[name] * damp
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * head_scale
    return wt.from_tensors(config, tensors)


@pytest.fixture(scope="module")
def model():
    return damped_model(PRESETS["test-tiny-gqa"])


def engine(model, spec=None, **kw):
    kw = {"num_pages": 64, "page_size": 32, "max_num_seqs": 8, "max_model_len": 256,
          "attention_backend": "reference", **kw}
    config, wise = SPECS[spec] if spec else (None, None)
    return wt.LLM(model, wise_config=wise, speculative_config=config, **kw)


def dense_tokens(model, prompts, params, **kw):
    return [o.token_ids for o in engine(model, **kw).generate(prompts, params, use_tqdm=False)]


def check_stats(llm, expect_rejections=True):
    s = llm.stats()
    assert s.free_pages == s.total_pages and s.running == s.waiting == 0
    assert 0 <= s.accepted_tokens <= s.draft_tokens
    if expect_rejections:
        assert 0 < s.acceptance_rate < 1, s.acceptance_rate
    return s


def test_run_loops_in_two_ranges_is_run_tokens(model):
    ids = torch.tensor(prompts_of([9], model.config.vocab_size)[0])
    ctx = SequenceContext(model.config, 1, 9, torch.float32, "cpu")
    whole = model.run_tokens(ids, ctx)
    h = model.run_loops(model.model.embed_tokens(ids), ctx, range(2))
    assert torch.equal(model.run_loops(h, ctx, range(2, 4)), whole)


@pytest.mark.parametrize("spec", KINDS)
def test_greedy_equals_dense_with_requests_joining_between_steps(model, spec):
    prompts = prompts_of([70, 3, 129, 40, 17], model.config.vocab_size)
    news = [9, 14, 5, 11, 2]
    llm = engine(model, spec, max_num_batched_tokens=64)       # long prompts prefill in chunks
    ids, produced, step = {}, {}, 0
    while len(ids) < len(prompts) or llm.has_unfinished():
        if step % 2 == 0 and len(ids) < len(prompts):
            i = len(ids)
            ids[llm.add_request(prompts[i], wt.SamplingParams(max_tokens=news[i], ignore_eos=True))] = i
        for out in llm.step():
            produced[ids[out.request_id]] = out
        step += 1
    for i, prompt in enumerate(prompts):
        want = dense_tokens(model, [prompt], wt.SamplingParams(max_tokens=news[i], ignore_eos=True))[0]
        assert produced[i].finished and produced[i].token_ids == want
    s = check_stats(llm)
    # Without stop tokens a round commits its accepted drafts and one dense token.
    assert s.decode_tokens == s.accepted_tokens + s.spec_rounds == sum(n - 1 for n in news)
    assert s.tokens_per_round == pytest.approx(1 + s.accepted_tokens / s.spec_rounds)
    if spec != "loops":
        assert s.fallbacks == 0 and 0 < s.density[2] < 1     # the draft's reuse loops ran sparse


def test_wise_draft_of_every_block_is_dense_and_always_accepted(model):
    prompts = prompts_of([40, 70], model.config.vocab_size, seed=4)
    params = wt.SamplingParams(max_tokens=12, ignore_eos=True)
    llm = wt.LLM(model, wise_config=WiseConfig(all_blocks=True), num_pages=16, page_size=32, max_num_seqs=2,
                 attention_backend="reference", speculative_config=wt.SpeculativeConfig("wise", num_draft=4))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == dense_tokens(model, prompts, params)
    s = check_stats(llm, expect_rejections=False)
    # 11 decoded tokens per request: rounds of 4 drafts + 1, 4 + 1, then the last token alone.
    assert s.acceptance_rate == 1.0 and s.spec_rounds == 6 and s.tokens_per_round == 11 / 3


@pytest.mark.parametrize("spec", KINDS)
def test_rejections_leave_no_trace(model, spec):
    """After every round each sequence holds the pages of its committed tokens only; no two
    draft tokens share a WISE token tag; and the committed K/V of every plane is dense: it equals
    a dense prefill of the same tokens."""
    prompts = prompts_of([30, 50, 3], model.config.vocab_size, seed=5)
    llm = engine(model, spec)
    tags, stage = [], llm.speculator._stage

    def recording(seqs, ks, bucket, width):
        stage(seqs, ks, bucket, width)
        meta = llm.speculator.meta[:, llm.speculator._TAG]
        tags.extend(meta[j, row].item() for row, k in enumerate(ks) for j in range(k + 1))
    llm.speculator._stage = recording
    ids = [llm.add_request(p, wt.SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
    for _ in range(8):
        llm.step()
        held = [len(seq.pages) for seq in llm.sequences.values()]
        assert held == [llm.blocks.pages_for(seq.num_cached) for seq in llm.sequences.values()]
        assert llm.blocks.num_free == llm.blocks.num_pages - sum(held)
    assert len(set(tags)) == len(tags) and tags == sorted(tags)
    s = llm.stats()
    assert 0 < s.acceptance_rate < 1 and s.running == 3
    dense = engine(model)
    cached = {rid: llm.sequences[rid].tokens[:llm.sequences[rid].num_cached] for rid in ids}
    dense_ids = {rid: dense.add_request(tokens, wt.SamplingParams(max_tokens=2)) for rid, tokens in cached.items()}
    dense.step()                                           # the prefill of every cached token, densely
    for rid in ids:
        n = len(cached[rid])
        spec_pages, dense_pages = (torch.tensor(e.sequences[i].pages) for e, i in ((llm, rid), (dense, dense_ids[rid])))
        for name in ("k", "v"):
            got = getattr(llm.runner.cache, name)[:, spec_pages].flatten(1, 2)[:, :n]
            want = getattr(dense.runner.cache, name)[:, dense_pages].flatten(1, 2)[:, :n]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)   # fp32: paged decode vs causal prefill


@pytest.mark.parametrize("spec", KINDS)
def test_preemption_and_abort_with_speculation(model, spec):
    prompts = prompts_of([60, 50, 45, 33], model.config.vocab_size, seed=1)
    params = wt.SamplingParams(max_tokens=30, ignore_eos=True)
    want = dense_tokens(model, prompts, params)
    llm = engine(model, spec, num_pages=8)                 # 8 pages of 32: the four cannot all grow
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert check_stats(llm).preemptions > 0
    llm = engine(model, spec)
    ids = [llm.add_request(p, params) for p in prompts]
    for _ in range(4):
        llm.step()
    held = llm.stats().free_pages
    out = llm.abort(ids[1])
    assert out.finish_reason == "abort" and 1 < len(out.token_ids) < 30
    assert llm.stats().free_pages == held + llm.blocks.pages_for(50 + len(out.token_ids) - 1)
    finals = llm.run_until_done([ids[0], ids[2], ids[3]])
    check_stats(llm)
    assert [f.token_ids for f in finals] == [want[0], want[2], want[3]]


def test_stop_tokens_logprobs_and_logits_match_dense(model):
    prompt = prompts_of([25], model.config.vocab_size, seed=6)[0]
    free = dense_tokens(model, [prompt], wt.SamplingParams(max_tokens=16, ignore_eos=True))[0]
    stop = free[7]                                         # a token that ends the request mid-round
    params = wt.SamplingParams(max_tokens=16, stop_token_ids=(stop,), logprobs=True)
    want = engine(model).generate([prompt], params, use_tqdm=False)[0]
    for spec in SPECS:
        llm = engine(model, spec)
        rid = llm.add_request(prompt, params, keep_logits=True)
        got = llm.run_until_done([rid])[0]
        assert got.finish_reason == "stop" and got.token_ids == want.token_ids == free[:free.index(stop) + 1]
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)  # fp32
        assert len(llm.stats().__dict__) and llm.stats().free_pages == llm.stats().total_pages


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    prompts = prompts_of([12, 30, 7], model.config.vocab_size, seed=3)
    params = [wt.SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    together = engine(model, "loops").generate(prompts, params, use_tqdm=False)
    alone = engine(model, "loops").generate([prompts[1]], params[1], use_tqdm=False)
    assert together[1].token_ids == alone[0].token_ids
    other_seed = engine(model, "loops").generate([prompts[0]], params[1], use_tqdm=False)
    assert together[0].token_ids != other_seed[0].token_ids


def test_sampling_in_the_greedy_limits_is_greedy(model):
    """A nucleus of one token (top_p tiny) or a tiny temperature makes both the draft and the
    dense distribution one-hot: rejection sampling must then give dense greedy tokens."""
    prompts = prompts_of([20, 45], model.config.vocab_size, seed=7)
    want = dense_tokens(model, prompts, wt.SamplingParams(max_tokens=12, ignore_eos=True))
    for spec in SPECS:
        for kw in (dict(temperature=1.0, top_p=1e-6), dict(temperature=1e-6)):
            llm = engine(model, spec)
            outs = llm.generate(prompts, wt.SamplingParams(max_tokens=12, ignore_eos=True, seed=5, **kw),
                                use_tqdm=False)
            assert [o.token_ids for o in outs] == want, (spec, kw)
            check_stats(llm)


def chi_square_bound(dof: int, z: float) -> float:
    """Wilson-Hilferty: the chi-square quantile with `dof` degrees of freedom at normal score z."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def joint_probabilities(model, prompt, new, loops, temperature):
    """{continuation: its probability} over every `new`-token continuation of `prompt` when each
    token is drawn from softmax(logits / temperature) of `loops` (the full-sequence forward)."""
    vocab = model.config.vocab_size
    heads = [prompt + list(c) for c in itertools.product(range(vocab), repeat=new - 1)]
    ids = torch.tensor(heads)
    ctx = SequenceContext(model.config, *ids.shape, torch.float32, "cpu")
    h = model.run_loops(model.model.embed_tokens(ids.flatten()), ctx, loops)
    logp = torch.log_softmax(model.logits(h).view(*ids.shape, vocab).double() / temperature, -1)
    out = {}
    for i, head in enumerate(itertools.product(range(vocab), repeat=new - 1)):
        base = sum(logp[i, len(prompt) - 1 + j, t] for j, t in enumerate(head))
        for last in range(vocab):
            out[head + (last,)] = math.exp(base + logp[i, len(prompt) + new - 2, last])
    return out


@pytest.mark.parametrize("spec", ["loops", "wise"])
def test_sampling_keeps_the_dense_distribution(spec):
    """4000 requests (half seeded, half on the engine's generator) sample 4 tokens at
    temperature 0.8 from a 4-token vocabulary (2 drafts per round, accepted 85-90 % of the
    time); the counts of the 256 continuations, cells of expected count < 5 pooled, must pass a
    chi-square test against the dense model's exact probabilities at normal score 4.75 (a
    correct sampler fails with probability about 1e-6; the seeds make the run deterministic).
    Power ("loops"): had the draft distribution been sampled instead, the expected statistic
    would exceed the bound five times over."""
    config = dataclasses.replace(PRESETS["test-tiny-gqa"], vocab_size=4)
    model = damped_model(config, seed=1, head_scale=3.0, damp=0.1 if spec == "loops" else 0.3)
    prompt, new, temperature, n = [1, 2, 3, 0, 1], 4, 0.8, 4000
    spec_config, wise = (wt.SpeculativeConfig("loops", num_draft=2, draft_loops=1), None) if spec == "loops" else (
        wt.SpeculativeConfig("wise", num_draft=2), WiseConfig(eta=0.3, block_size=4))
    llm = wt.LLM(model, wise_config=wise, speculative_config=spec_config, num_pages=256, page_size=32,
                 max_num_seqs=256, max_model_len=32, attention_backend="reference", seed=0)
    params = [wt.SamplingParams(max_tokens=new, temperature=temperature, ignore_eos=True,
                                seed=i if i % 2 else None) for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    s = check_stats(llm)
    p = joint_probabilities(model, prompt, new, range(4), temperature)
    counts = dict.fromkeys(p, 0)
    for out in outs:
        counts[tuple(out.token_ids)] += 1
    big = [c for c in p if n * p[c] >= 5]                   # cells of expected count < 5 pooled into one
    pooled = [c for c in p if n * p[c] < 5]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in pooled)]
    expected = [n * p[c] for c in big] + [n * sum(p[c] for c in pooled)]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    bound = chi_square_bound(len(big), 4.75)
    assert len(big) >= 20 and stat < bound, (stat, bound, s.acceptance_rate)
    if spec == "loops":
        q = joint_probabilities(model, prompt, new, range(1), temperature)
        assert n * sum((q[c] - p[c]) ** 2 / p[c] for c in p) > 5 * bound


def test_bad_speculative_settings_are_named(model):
    with pytest.raises(TypeError, match="speculative_config must be a SpeculativeConfig"):
        wt.LLM(model, num_pages=4, speculative_config={"method": "wise"})
    with pytest.raises(ConfigError, match="pass no wise_config"):
        wt.LLM(model, num_pages=4, wise_config=WISE, speculative_config=wt.SpeculativeConfig("loops"))
    with pytest.raises(ConfigError, match="needs a WiseConfig with a reuse depth"):
        wt.LLM(model, num_pages=4, wise_config=WiseConfig(reuse_depths=()),
               speculative_config=wt.SpeculativeConfig("wise"))
    llm = engine(model, "wise")
    assert llm.runner.wise is not None and llm.speculator.depth == 2
    with pytest.raises(ValueError, match="forced continuation .* is scored, not speculated"):
        llm.add_request([1, 2], forced=[3, 4])
    assert engine(model).stats().acceptance_rate is None
    with pytest.raises(ConfigError, match="sparse_discovery applies to method 'wise'"):
        wt.SpeculativeConfig("loops", sparse_discovery=True)
    with pytest.raises(ConfigError, match="sparse_discovery must be a bool"):
        wt.SpeculativeConfig("wise", sparse_discovery=1)
    assert engine(model, "wise-sparse").speculator.depth == 0      # verification recomputes every loop


def recorded_rounds(llm, plant=None) -> list[dict]:
    """Record the speculative rounds of `llm`: per round its rows' (token, cached length) at
    staging, draft counts and metadata [queries, 6, rows], and per draft step its kind, the
    WISE supports and tags after it (step 0: also before it) and the modes of a sparse step's
    loops. plant(wise, meta): called right after each round's step 0."""
    spec, wise = llm.speculator, llm.runner.wise
    stage, forward, sparse_modes = spec._stage, spec._draft_forward, wise.sparse_draft_modes
    rounds, modes = [], []

    def staging(seqs, ks, bucket, width):
        stage(seqs, ks, bucket, width)
        rounds.append(dict(rows=[(seq.tokens[-1], len(seq.tokens)) for seq in seqs], ks=list(ks),
                           meta=spec.meta.clone(), steps=[]))

    def stepping(bucket, kind, width):
        before, steps = wise.support.clone(), rounds[-1]["steps"]
        modes.clear()
        out = forward(bucket, kind, width)
        if not steps and plant is not None:
            plant(wise, spec.meta)
        steps.append(dict(kind=kind, before=before, support=wise.support.clone(), tags=wise.tag.clone(),
                          modes=list(modes)))
        return out

    def moding(loop, *args):
        m = sparse_modes(loop, *args)
        modes.append(m.clone())
        return m

    spec._stage, spec._draft_forward, wise.sparse_draft_modes = staging, stepping, moding
    return rounds


def sparse_steps(rounds):
    """(round, step index j, rows drafting at j) of every sparse draft step."""
    for r in rounds:
        for j, step in enumerate(r["steps"][1:], 1):
            if step["kind"] == "sparse":
                yield r, j, [i for i, k in enumerate(r["ks"]) if k >= j]


def test_sparse_drafts_attend_their_last_verified_tokens_support(model):
    """Every loop of a sparse-discovery draft token attends exactly the support its request's
    last verified token discovered in the round's first step (tags of that token, untouched),
    plus the blocks of the keys after it; the supports found before (a stale read) differ."""
    prompts = prompts_of([70, 33, 100], model.config.vocab_size, seed=11)
    params = wt.SamplingParams(max_tokens=16, ignore_eos=True)
    llm = engine(model, "wise-sparse")
    rounds = recorded_rounds(llm)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == dense_tokens(model, prompts, params)
    assert check_stats(llm).fallbacks == 0
    s = llm.speculator
    pos, tag, token, bs = s._POSITION, s._TAG, s._TOKEN, WISE.block_size
    for r in rounds:
        meta = r["meta"]
        for i, (last, length) in enumerate(r["rows"]):    # step 0 feeds each row's last verified token
            assert (meta[0, token, i], meta[0, pos, i]) == (last, length - 1)
    checked, stale = 0, 0
    for r, j, rows in sparse_steps(rounds):
        meta, first, step = r["meta"], r["steps"][0], r["steps"][j]
        assert len(step["modes"]) == 4                    # every loop on the support, discovery loops included
        for i in rows:
            assert meta[j, pos, i] == meta[0, pos, i] + j                 # the same request's row
            assert bool((step["tags"][i] == meta[0, tag, i]).all())
            want = first["support"][:, i].clone()
            want[:, :, (meta[0, pos, i] + 1) // bs:meta[j, pos, i] // bs + 1] = True
            assert torch.equal(step["support"][:, i], want)
            assert all(bool((m[:, i] == SPARSE).all()) for m in step["modes"])
            checked += 1
            stale += not torch.equal(first["before"][:, i], first["support"][:, i])
    assert checked > 20 and stale > 0


def test_a_sparse_draft_without_its_verified_tokens_support_attends_densely(model):
    """Row 0's support tagged, after each round's step 0, with a token of the previous round (a
    stale support): its draft steps attend densely at every loop (counted as fallbacks at the 2
    reuse depths of every layer), the other rows sparsely; the tokens stay dense's."""
    prompts = prompts_of([70, 33, 100], model.config.vocab_size, seed=11)
    params = wt.SamplingParams(max_tokens=16, ignore_eos=True)
    llm = engine(model, "wise-sparse")
    tag = llm.speculator._TAG

    def plant(wise, meta):
        wise.tag[0] = meta[0, tag, 0] - 1

    rounds = recorded_rounds(llm, plant)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == dense_tokens(model, prompts, params)
    steps = 0
    for r, j, rows in sparse_steps(rounds):
        assert rows[0] == 0
        for m in r["steps"][j]["modes"]:
            assert bool((m[:, 0] == DENSE).all()) and all(bool((m[:, i] == SPARSE).all()) for i in rows[1:])
        steps += 1
    assert steps > 0 and check_stats(llm).fallbacks == steps * 2 * model.config.num_hidden_layers


def _set_acceptance_rounds(rate: float, seed: int, num_draft: int, prompt_len: int, new: int) -> tuple[int, int]:
    """(rounds, accepted drafts) of one request under a set acceptance (rate, seed:
    `benchmarks.engine.speculative_arms.set_acceptance`), by hand: a round drafts min(num_draft, tokens left - 1), draws num_draft
    uniforms, accepts the drafted prefix below the rate and commits it plus one token."""
    rng = np.random.default_rng(seed)
    length, end, rounds, accepted = prompt_len + 1, prompt_len + new, 0, 0
    while length < end:
        k = max(min(num_draft, end - length - 1), 0)
        keep = rng.random((1, num_draft))[0, :k] < rate
        n = int(np.cumprod(keep).sum())
        rounds, accepted, length = rounds + 1, accepted + n, min(length + n + 1, end)
    return rounds, accepted


@pytest.mark.parametrize("spec", KINDS)
def test_set_acceptance_accepts_the_seeded_bernoulli_prefix(model, spec):
    """A set acceptance (timing only, the engine's measurement hook that
    benchmarks/engine/speculative_arms.py sets): the counts a hand-computed Bernoulli sequence
    gives, every page back; at rate 0 the output is dense's (every draft rejected, the
    verification's greedy token kept), at rate 1 every draft is accepted."""
    from benchmarks.engine.speculative_arms import set_acceptance
    prompt, new = prompts_of([40], model.config.vocab_size, seed=5)[0], 23
    params = wt.SamplingParams(max_tokens=new, ignore_eos=True)
    config, wise = SPECS[spec]
    for rate, seed in ((0.5, 7), (0.0, 1), (1.0, 2)):
        llm = wt.LLM(model, wise_config=wise, speculative_config=config, num_pages=64, page_size=32,
                     max_num_seqs=8, max_model_len=256, attention_backend="reference")
        set_acceptance(llm, rate, seed)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        s = llm.stats()
        assert len(out.token_ids) == new and s.free_pages == s.total_pages and s.running == s.waiting == 0
        assert (s.spec_rounds, s.accepted_tokens) == _set_acceptance_rounds(rate, seed, config.num_draft, 40, new)
        if rate == 0.0:
            assert out.token_ids == dense_tokens(model, [prompt], params)[0]
        if rate == 1.0:
            assert s.accepted_tokens == s.draft_tokens > 0


def test_adaptive_draft_count_follows_the_expected_tokens_per_cost():
    config = wt.SpeculativeConfig("wise", num_draft=4, adaptive=True, draft_cost=0.75)
    counts = [config.draft_count(100.0, 100.0 * a) for a in np.linspace(0, 1, 41)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4     # more acceptance, more drafts
    # a = 0.9: 1 draft commits 1.9 tokens at cost 1.75 (1.0857), 2 drafts 2.71 at 2.5 (1.084)
    assert config.draft_count(100.0, 90.0) == 1
    assert config.draft_count(0.0, 0.0) == 1              # the prior (0.8): (1 + 0.8) / 1.75 > 1
    assert config.draft_count(1.0, 0.0) == 0              # one rejected: 0.4
    assert wt.SpeculativeConfig("wise", num_draft=4, adaptive=True, draft_cost=0.2).draft_count(0.0, 0.0) == 4
    for bad in (0, -1.0, math.inf, True, "1"):
        with pytest.raises(ConfigError, match="draft_cost must be a positive finite number"):
            wt.SpeculativeConfig("wise", draft_cost=bad)
    with pytest.raises(ConfigError, match="adaptive must be a bool"):
        wt.SpeculativeConfig("wise", adaptive=1)


@pytest.mark.parametrize("spec", KINDS)
def test_adaptive_drafting_equals_dense_and_follows_the_acceptance(model, spec):
    """Greedy tokens equal dense whatever each round drafts; under a set acceptance of 0 a
    request soon stops drafting (a probe now and then), at 1 it drafts num_draft."""
    prompts = prompts_of([40, 70, 25], model.config.vocab_size, seed=8)
    params = wt.SamplingParams(max_tokens=30, ignore_eos=True)
    config, wise = SPECS[spec]
    adaptive = dataclasses.replace(config, adaptive=True)
    llm = wt.LLM(model, wise_config=wise, speculative_config=adaptive, num_pages=64, page_size=32, max_num_seqs=8,
                 max_model_len=256, attention_backend="reference")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == dense_tokens(model, prompts, params)
    check_stats(llm, expect_rejections=False)
    assert not llm.speculator.history                     # forgotten as the requests finished
    per_round = {}
    from benchmarks.engine.speculative_arms import set_acceptance
    for rate in (0.0, 1.0):
        set_llm = wt.LLM(model, wise_config=wise, speculative_config=adaptive, num_pages=64, page_size=32,
                         max_num_seqs=8, max_model_len=256, attention_backend="reference")
        set_acceptance(set_llm, rate)
        set_llm.generate(prompts, params, use_tqdm=False)
        s = check_stats(set_llm, expect_rejections=False)
        per_round[rate] = s.draft_tokens / s.spec_rounds
    assert per_round[0.0] < 0.5 and per_round[1.0] > config.num_draft - 1, per_round


@pytest.mark.parametrize("discover, draft_loops, sparse", [((0,), 2, False), ((0, 1), 3, False), ((0, 1), 3, True)],
                         ids=["2-loop", "3-loop", "3-loop-sparse"])
def test_truncated_wise_drafts_equal_dense(model, discover, draft_loops, sparse):
    """A WISE draft of the first draft_loops loops (its reuse loops among them sparse; with
    sparse discovery every loop of a draft token), then the LM head: greedy tokens equal dense;
    verification recomputes from the first reuse depth (sparse discovery: from loop 0)."""
    wise = WiseConfig(eta=0.5, discover_depths=discover,
                      reuse_depths=tuple(range(len(discover), 4)))
    config = wt.SpeculativeConfig("wise", num_draft=3, draft_loops=draft_loops, sparse_discovery=sparse)
    prompts = prompts_of([40, 70], model.config.vocab_size, seed=9)
    params = wt.SamplingParams(max_tokens=20, ignore_eos=True)
    llm = wt.LLM(model, wise_config=wise, speculative_config=config, num_pages=64, page_size=32, max_num_seqs=8,
                 max_model_len=256, attention_backend="reference")
    assert (llm.speculator.depth, llm.speculator.draft_end) == (0 if sparse else len(discover), draft_loops)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == dense_tokens(model, prompts, params)
    s = check_stats(llm, expect_rejections=False)
    assert s.fallbacks == 0 and 0 < s.density[len(discover)] < 1         # the draft's reuse loop ran sparse
    for bad in (2, 5):
        with pytest.raises(ConfigError, match=r"draft_loops must be in \[3, 4\]"):
            wt.LLM(model, wise_config=WISE, num_pages=4, speculative_config=wt.SpeculativeConfig("wise", draft_loops=bad))
