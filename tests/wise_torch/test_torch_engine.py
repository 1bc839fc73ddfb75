"""wise_torch.LLM beyond what both engines share (tests/wise_core/engine/test_engine.py): step outputs with stop
tokens, logprobs and text, padding rows, the sampler, the torch engine's own arguments."""

import math

import pytest
import torch

import wise_torch as wt
from wise_core import ouro_reference as R
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig
from wise_torch.attention import AttentionPlan
from wise_torch.engine.sampler import sample
from cases import prompts_of

@pytest.fixture(scope="module")
def model():
    config = PRESETS["test-tiny-gqa"]
    return wt.from_tensors(config, random_tensors(config, seed=0, std=0.08))


def engine(model, wise_config=None, build=wt.LLM, **kw):
    kw = {"num_pages": 64, "page_size": 32, "max_num_seqs": 8, "max_model_len": 256, "attention_backend": "reference",
          **kw}
    return build(model, wise_config=wise_config, **kw)


def test_step_outputs_stop_tokens_logprobs_and_text():
    llm = wt.LLM("random-tiny", num_pages=16, page_size=32, max_num_seqs=2, attention_backend="reference")
    a = llm.add_request("hello", wt.SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True))
    assert llm.step() == []                                # the prefill runs; its token is read a step later
    first = llm.step()
    assert [o.request_id for o in first] == [a] and len(first[0].token_ids) == 1
    stop = first[0].token_ids[0]
    b = llm.add_request("hello", wt.SamplingParams(max_tokens=5, stop_token_ids=(stop,)))
    llm.step()
    outs = {o.request_id: o for o in llm.step()}
    assert outs[b].finished and outs[b].finish_reason == "stop" and outs[b].token_ids == [stop]
    final = llm.run_until_done([a])[0]
    assert final.text == llm.tokenizer.decode(final.token_ids)
    assert len(final.logprobs) == 5 and all(lp <= 0 for lp in final.logprobs)
    forced = wt.teacher_force(llm.model, llm.tokenizer.encode("hello").ids, final.token_ids)
    torch.testing.assert_close(torch.tensor(final.logprobs), forced.logprobs[0], atol=1e-5, rtol=0)  # fp32


def test_padding_rows_write_only_the_scratch_page(model):
    llm = engine(model, num_pages=8)
    llm.generate(prompts_of([10, 20, 30], model.config.vocab_size), wt.SamplingParams(max_tokens=3),
                 use_tqdm=False)                           # 3 rows decode at bucket 4
    k = llm.runner.cache.k
    assert not k[:, 3:8].any()                             # pages no request held stay untouched
    assert k[:, llm.runner.cache.scratch_page].any()       # the padding row wrote here


def test_sampler_from_tiny_to_huge_temperatures():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 6, generator=g) * 3
    logits[:, 2] += 0.5
    greedy = logits.argmax(-1)
    for t in (1e-30, 1e-10, 1e-6):                         # log space: never overflows, greedy in the limit
        assert torch.equal(sample(logits, [t] * 4000, [wt.SamplingParams()] * 4000, [g] * 4000), greedy)
    row = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5, 3.0]])
    for t in (1.0, 1e3):                                   # the empirical distribution is softmax(row / t)
        drawn = sample(row.expand(20000, 6), [t] * 20000, [wt.SamplingParams()] * 20000, [g] * 20000)
        freq = torch.bincount(drawn, minlength=6).double() / 20000
        want = torch.softmax(row[0].double() / t, -1)
        # 5 binomial standard deviations of a frequency over 20000 draws
        assert bool(((freq - want).abs() <= 5 * (want * (1 - want) / 20000).sqrt() + 1e-12).all()), (t, freq, want)
    def drawn(**filters):
        return set(sample(row.expand(2000, 6), [1.0] * 2000, [wt.SamplingParams(**filters)] * 2000,
                          [g] * 2000).tolist())
    assert drawn(top_p=0.6) == {5} and drawn(top_p=0.7) == {5, 2}   # p(5) = 0.605, p(2) = 0.222
    assert drawn(top_k=3) == {5, 2, 1} and drawn(top_k=1) == {5}
    # min_p 0.3: p >= 0.3 p_max, i.e. logit >= 3 + ln 0.3 = 1.80: tokens 5 and 2
    assert drawn(min_p=0.3) == {5, 2} and drawn(min_p=1.0) == {5}
    # In order: min_p 0.05 keeps 4 tokens (0 and 3 fall below), top_k 3 three of them, top_p 0.8
    # of those renormalised (0.665, 0.245, ...) two.
    assert drawn(min_p=0.05) == {5, 2, 1, 4} and drawn(min_p=0.05, top_k=3, top_p=0.8) == {5, 2}
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0]]).expand(500, 4)             # top_k 1 of a tie: the lower id
    assert set(sample(tied, [1.0] * 500, [wt.SamplingParams(top_k=1)] * 500, [g] * 500).tolist()) == {1}


def test_bad_inputs_are_named(model):
    """The torch engine's own arguments and SamplingParams' checks (the requests every engine
    refuses: tests/wise_core/engine/test_engine.py)."""
    for bad, match in ((dict(max_tokens=0), "max_tokens must be a positive integer"),
                       (dict(temperature=-1.0), "temperature must be >= 0"),
                       (dict(temperature="0.5"), "temperature must be a finite number"),
                       (dict(temperature=math.inf), "temperature must be a finite number"),
                       (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                       (dict(seed=2 ** 70), r"seed must be None or an integer in \[0, 2\*\*63\)"),
                       (dict(ignore_eos="no"), "ignore_eos must be a bool")):
        with pytest.raises(ValueError, match=match):
            wt.SamplingParams(**bad)
    for kw, match in ((dict(num_pages=0), "num_pages must be a positive integer"),
                      (dict(page_size=48, wise_config=WiseConfig()), "page_size must be a multiple of the block_size 32"),
                      (dict(max_model_len=5000), r"exceeds the model's max_position_embeddings \(1024\)"),
                      (dict(cuda_graphs=True), "cuda_graphs=True needs the model on a CUDA device"),
                      (dict(cuda_graphs="yes"), "cuda_graphs must be True, False or 'auto'"),
                      (dict(attention_backend="pallas"), "'pallas' is not one of wise_torch's"),
                      (dict(attention_backend="flash"), "attention_backend must be one of")):
        with pytest.raises(ValueError, match=match):
            engine(model, **kw)
    with pytest.raises(TypeError, match="wise_config must be a WiseConfig"):
        engine(model, wise_config={"eta": 0.9})
    with pytest.raises(TypeError, match="model must be an OuroForCausalLM"):
        wt.LLM(3)


def test_fp8_pools_refuse_the_paths_that_do_not_read_them_and_run_the_reference_prefill(model):
    """kv_cache_dtype="fp8" (tests/wise_core/engine/test_engine_fp8.py runs it in both engines):
    torch's fast paths that do not read fp8 pages yet are refused, each error naming its option
    (the attention backends, and the arms a benchmark sets through `torch_engine_with`);
    attention_backend "auto" resolves to the reference (SDPA prefill), and the packed "reference"
    prefill reads the pages dequantized, giving the tokens of the numpy reference over an fp8
    cache."""
    from benchmarks.engine.arms import torch_engine_with
    for build, kw, option in (
            (wt.LLM, dict(attention_backend="fa4"), "attention_backend='fa4'"),
            (wt.LLM, dict(attention_backend="triton"), "attention_backend='triton'"),
            (torch_engine_with(prefill="fa4"), {}, "prefill='fa4'"),
            (torch_engine_with(dense_decode="fa4"), {}, "dense_decode='fa4'"),
            (torch_engine_with(wise_decode="fa4-union"), dict(wise_config=WiseConfig()), "wise_decode='fa4-union'"),
            (torch_engine_with(wise_decode="reference-union"), dict(wise_config=WiseConfig()),
             "wise_decode='reference-union'"),
            (wt.LLM, dict(speculative_config=SpeculativeConfig()), "speculative decoding")):
        with pytest.raises(ValueError, match=rf"{option}.* does not read kv_cache_dtype='fp8' pages yet"):
            engine(model, kv_cache_dtype="fp8", build=build, **kw)
    fp8 = engine(model, kv_cache_dtype="fp8", attention_backend="auto")
    assert fp8.attention_plan == AttentionPlan("reference", "sdpa") and fp8.runner.prefill_attention == "sdpa"
    llm = engine(model, kv_cache_dtype="fp8", build=torch_engine_with(prefill="reference"), max_num_batched_tokens=64)
    prompts = prompts_of([70, 9], model.config.vocab_size, seed=3)     # 70: two chunks, the second over pages
    outs = llm.generate(prompts, wt.SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    tensors = random_tensors(model.config, seed=0, std=0.08)
    assert [o.token_ids for o in outs] == [R.generate(model.config, tensors, p, 6, kv_quant=True)[0] for p in prompts]
