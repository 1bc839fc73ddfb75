"""Packed varlen prefill over the paged pool (wise_torch): the step's chunks as `VarlenPrefill`
metadata (hand-computed values), the plain-torch varlen attention against one SDPA per
request, the FlashAttention-4 calls' arguments (prefill, and the dense decode arm) through a
stand-in `flash_attn.cute` (FA4 itself runs only in the `gpu` tests, on an H200), what each
attention_backend runs in prefill and dense decode (`attention_plan`) and its fallback, and the
engine's tokens with the packed path equal to grouped SDPA's (chunked and
whole prompts, dense and WISE, prefix caching on). CPU, fp32."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from wise_core.checkpoint import random_tensors
from wise_core.engine.scheduler import Chunk
from wise_core.engine.sequence import Sequence
from wise_core.modes import DENSE
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_core.wise_config import WiseConfig
from benchmarks.engine.arms import torch_engine_with
from wise_torch.attention import (AttentionPlan, attention_plan, decode_attention_reference, dense_decode_function,
                                  prefill_attention, prefill_attention_varlen_reference, prefill_function)
from wise_torch.engine.model_runner import ModelRunner
from wise_torch.kernels import fa4
from wise_torch.kv_cache import VarlenPrefill

from cases import held_slots
from fa4_cases import stand_in_fa4

CONFIG = PRESETS["test-tiny-gqa"]
WISE = WiseConfig(eta=0.5)


@pytest.fixture(scope="module")
def model():
    import wise_torch
    return wise_torch.from_tensors(CONFIG, random_tensors(CONFIG, seed=0, std=0.08))


# -- the metadata -----------------------------------------------------------------------------
def test_varlen_metadata_by_hand():
    # page_size 4, scratch page 10: a whole 3-token prompt; a chunk from position 6 (mid-page,
    # 11 keys, 3 pages); one token at position 8 of a request holding more pages than it needs.
    v = VarlenPrefill.build([(0, 3, [5]), (6, 5, [2, 7, 9]), (8, 1, [1, 3, 4, 0])], page_size=4, scratch_page=10)
    assert v.cu_seqlens_q.tolist() == [0, 3, 8, 9] and v.cu_seqlens_q.dtype == torch.int32
    assert v.seqused_k.tolist() == [3, 11, 9] and v.seqused_k.dtype == torch.int32
    assert v.page_table.tolist() == [[5, 10, 10], [2, 7, 9], [1, 3, 4]] and v.page_table.dtype == torch.int32
    assert v.max_seqlen_q == 5 and v.size == 3


@pytest.mark.parametrize("chunks, match", [([(4, 5, [1, 2])], "needs 3 pages"), ([(0, 0, [1])], "length > 0"),
                                           ([], "at least one chunk")])
def test_varlen_metadata_refuses_bad_chunks(chunks, match):
    with pytest.raises(ValueError, match=match):
        VarlenPrefill.build(chunks, page_size=4, scratch_page=10)


def sequence(i, prompt_len, pages):
    return Sequence(request_id=i, prompt=list(range(1, prompt_len + 1)), params=SamplingParams(),
                    eos_token_ids=frozenset(), arrival=i, pages=pages)


def runner(model, prefill_attention):
    return ModelRunner(model, wise_config=None, num_pages=12, page_size=16, max_num_seqs=4, max_model_len=64,
                       use_graphs=False, attention=AttentionPlan("reference", prefill_attention), seed=0)


def test_runner_packs_a_steps_chunks_and_matches_grouped_sdpa(model):
    """One step of four requests' chunks: A from position 10 (mid-page, after its first chunk),
    B and D whole prompts of one (start, length) (one SDPA group), C the first 20 of 40 tokens.
    The packed call's metadata follows the flat token order, group by group (A, B, D, C)."""
    a, b, c, d = sequence(0, 20, [3, 7]), sequence(1, 5, [1]), sequence(2, 40, [4, 5, 6]), sequence(3, 5, [9])
    seen = []

    def spy(q, k_pages, v_pages, varlen):
        seen.append((q.shape, varlen))
        return prefill_attention_varlen_reference(q, k_pages, v_pages, varlen)

    logits = {}
    for kind in ("sdpa", "reference"):
        r = runner(model, kind)
        assert r.prefill_attention == kind
        if kind == "reference":
            r.prefill_fn = spy
        r.prefill([Chunk(a, 0, 10)])
        logits[kind], _ = r.prefill([Chunk(a, 10, 10), Chunk(b, 0, 5), Chunk(c, 0, 20), Chunk(d, 0, 5)])
    planes = CONFIG.num_loops * CONFIG.num_hidden_layers
    assert len(seen) == 2 * planes                       # one packed call per plane and step
    shape, v = seen[-1]
    scratch = 12
    assert tuple(shape) == (40, CONFIG.num_attention_heads, CONFIG.head_dim)
    assert v.cu_seqlens_q.tolist() == [0, 10, 15, 20, 40]
    assert v.seqused_k.tolist() == [20, 5, 5, 20]
    assert v.page_table.tolist() == [[3, 7], [1, scratch], [9, scratch], [4, 5]] and v.max_seqlen_q == 20
    # A, B and D complete their prompts; fp32 logits of a 2-layer x 4-loop model whose attention
    # sums differ in order only (einsum against SDPA): agreement to ~1e-6 relative, 1e-4 allows
    # growth through 8 layer applications.
    assert logits["sdpa"].shape == (3, CONFIG.vocab_size)
    torch.testing.assert_close(logits["reference"], logits["sdpa"], rtol=1e-4, atol=1e-4)


# -- the attention ----------------------------------------------------------------------------
def random_pool(seed, pages=10, page_size=8, kv_heads=2, head_dim=16):
    g = torch.Generator().manual_seed(seed)
    shape = (pages + 1, page_size, kv_heads, head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), g


def test_varlen_reference_equals_sdpa_per_request():
    k_pages, v_pages, g = random_pool(0)
    chunks = [(0, 13, [4, 1]), (11, 6, [7, 0, 9]), (5, 1, [2]), (16, 8, [3, 5, 6])]   # offsets mid-page and at a page
    v = VarlenPrefill.build(chunks, page_size=8, scratch_page=10)
    heads = 4
    q = torch.randn(int(v.cu_seqlens_q[-1]), heads, 16, generator=g)
    out = prefill_attention_varlen_reference(q, k_pages, v_pages, v)
    row = 0
    for start, length, pages in chunks:
        keys = start + length
        k = k_pages[pages].flatten(0, 1)[None, :keys]
        vv = v_pages[pages].flatten(0, 1)[None, :keys]
        want = prefill_attention(q[None, row:row + length], k, vv, start=start)[0]
        # fp32 both, softmax over <= 24 keys of O(1) scores: rounding ~1e-7 relative; 1e-5 bounds it.
        torch.testing.assert_close(out[row:row + length], want, rtol=1e-5, atol=1e-5)
        row += length


def test_varlen_reference_ignores_keys_past_each_chunk():
    """Keys past a request's seqused_k (the rest of its last page, the scratch page) do not
    change its output: NaN written there stays out."""
    k_pages, v_pages, g = random_pool(1)
    v = VarlenPrefill.build([(3, 2, [4]), (0, 9, [1, 2])], page_size=8, scratch_page=10)
    q = torch.randn(11, 2, 16, generator=g)
    want = prefill_attention_varlen_reference(q, k_pages, v_pages, v)
    for pool in (k_pages, v_pages):
        pool[4, 5:] = float("nan")
        pool[2, 1:] = float("nan")
        pool[10] = float("nan")
    assert torch.equal(prefill_attention_varlen_reference(q, k_pages, v_pages, v), want)


# -- FlashAttention-4 through a stand-in module --------------------------------------------------
def test_fa4_call_reads_the_pool_in_place(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", stand_in_fa4(calls))
    k_pages, v_pages, g = random_pool(2)
    v = VarlenPrefill.build([(0, 7, [3]), (9, 4, [5, 8])], page_size=8, scratch_page=10)
    q = torch.randn(11, 4, 16, generator=g)
    out = fa4.prefill_attention_varlen(q, k_pages, v_pages, v)
    assert calls == [k_pages.data_ptr()]                 # the pool itself: no gathered copy
    assert torch.equal(out, prefill_attention_varlen_reference(q, k_pages, v_pages, v))


@pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])
def test_engine_through_stand_in_fa4_gives_sdpa_tokens(model, monkeypatch, wise_config):
    """The engine's packed calls (chunked, prefix cached) pass FA4's argument checks and give
    grouped SDPA's tokens. ("fa4" itself needs CUDA: the runner's function is swapped in.)"""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", stand_in_fa4(calls))
    prompts = shared_prompts()
    want = run(model, prompts, "sdpa", wise_config, max_num_batched_tokens=24)
    got = run(model, prompts, "reference", wise_config, max_num_batched_tokens=24,
              swap=fa4.prefill_attention_varlen)
    assert got == want and calls


def test_fa4_dense_decode_equals_reference_dense_rows(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", stand_in_fa4(calls))
    k_pages, v_pages, g = random_pool(3)
    table = torch.tensor([[4, 1, 10], [7, 10, 10], [2, 3, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([13, 5, 24], dtype=torch.int32)
    q = torch.randn(3, 4, 16, generator=g)
    out = fa4.decode_attention_dense(q, k_pages, v_pages, table, seq_lens)
    assert calls == [("decode", k_pages.data_ptr())]
    support = torch.zeros(3, 4, 3, dtype=torch.bool)
    modes = torch.full((3,), DENSE, dtype=torch.int32)
    want, _ = decode_attention_reference(q, k_pages, v_pages, table, seq_lens, modes, support, block_size=8, eta=0.9)
    # fp32 both, softmax over <= 24 keys of O(1) scores: rounding ~1e-7 relative; 1e-5 bounds it.
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wise_config", [None, WiseConfig(eta=0.5, discover_depths=(1,),
                                                            reuse_depths=(2, 3))], ids=["dense", "wise"])
def test_engine_dense_decode_through_stand_in_fa4_gives_kernel_tokens(model, monkeypatch, wise_config):
    """Dense decode loops through FA4's paged decode (the stand-in: "fa4" itself needs CUDA)
    give the decode kernel's tokens; with WISE only its dense loops (here loop 0) take it."""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", stand_in_fa4(calls))
    prompts = shared_prompts()
    want = run(model, prompts, "sdpa", wise_config)
    got = run(model, prompts, "sdpa", wise_config, swap_decode=fa4.decode_attention_dense)
    assert got == want and calls and all(c[0] == "decode" for c in calls)


# -- the choice -------------------------------------------------------------------------------
def test_dense_decode_function(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", stand_in_fa4([]))
    assert dense_decode_function("kernel", "cpu", torch.float32) is None
    assert dense_decode_function("fa4", "cuda", torch.bfloat16) is fa4.decode_attention_dense
    with pytest.raises(RuntimeError, match="runs on a CUDA device"):
        dense_decode_function("fa4", "cpu", torch.float32)
    with pytest.raises(ValueError, match="is not one of wise_torch's"):
        dense_decode_function("auto", "cuda", torch.bfloat16)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    with pytest.raises(RuntimeError, match="dense_decode='fa4' needs FlashAttention-4 .*flash-attn-4"):
        dense_decode_function("fa4", "cuda", torch.bfloat16)


def test_attention_plan_and_prefill_function(monkeypatch):
    """What each attention_backend runs (docs/attention.md's table), FA4 importable (the stand-in)."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", stand_in_fa4([]))
    assert attention_plan("auto", "cuda", torch.bfloat16, 64) == AttentionPlan("triton", "fa4")
    assert attention_plan("auto", "cuda", torch.bfloat16, 40) == AttentionPlan("reference", "fa4")  # Triton: 16k
    assert attention_plan("auto", "cpu", torch.bfloat16, 64) == AttentionPlan("reference", "sdpa")   # FA4 needs CUDA
    assert attention_plan("auto", "cuda", torch.float32, 64) == AttentionPlan("triton", "sdpa")      # ... and fp16/bf16
    assert attention_plan("fa4", "cuda", torch.float16, 64) == AttentionPlan("triton", "fa4", dense_decode="fa4")
    assert attention_plan("triton", "cpu", torch.float32, 64) == AttentionPlan("triton", "sdpa")
    assert attention_plan("reference", "cuda", torch.bfloat16, 64) == AttentionPlan("reference", "sdpa")
    with pytest.raises(RuntimeError, match="attention_backend='fa4' runs on a CUDA device in float16 or bfloat16"):
        attention_plan("fa4", "cpu", torch.bfloat16, 64)
    with pytest.raises(ValueError, match="is not one of wise_torch's"):
        attention_plan("pallas", "cuda", torch.bfloat16, 64)
    assert prefill_function("sdpa", "cuda", torch.bfloat16) is None
    assert prefill_function("reference", "cpu", torch.float32) is prefill_attention_varlen_reference
    assert prefill_function("fa4", "cuda", torch.float16) is fa4.prefill_attention_varlen
    with pytest.raises(RuntimeError, match="runs on a CUDA device in float16 or bfloat16"):
        prefill_function("fa4", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="is not one of wise_torch's"):
        prefill_function("flash", "cuda", torch.bfloat16)


def test_without_fa4_auto_falls_back_and_fa4_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)    # import raises ImportError
    assert fa4.import_error() is not None
    assert attention_plan("auto", "cuda", torch.bfloat16, 64) == AttentionPlan("triton", "sdpa")
    with pytest.raises(RuntimeError, match="flash-attn-4"):
        attention_plan("fa4", "cuda", torch.bfloat16, 64)


def test_engine_records_its_prefill_attention(model):
    import wise_torch
    kw = dict(num_pages=16, page_size=32, max_num_seqs=2, max_model_len=128)
    assert wise_torch.LLM(model, attention_backend="reference", **kw).stats().prefill_attention == "sdpa"
    assert wise_torch.LLM(model, **kw).stats().prefill_attention == "sdpa"     # "auto" on a CPU
    packed = torch_engine_with(prefill="reference")(model, attention_backend="reference", **kw)
    assert packed.stats().prefill_attention == "reference"
    with pytest.raises(RuntimeError, match="CUDA device"):
        wise_torch.LLM(model, attention_backend="fa4", **kw)


# -- the engine -------------------------------------------------------------------------------
def shared_prompts(n=5, common=75, seed=0):
    """n prompts sharing a 75-token prefix (two full pages of 32, then part of a third), each
    with its own suffix of 7 to 39 tokens."""
    g = np.random.default_rng(seed)
    prefix = g.integers(0, CONFIG.vocab_size, common).tolist()
    return [prefix + g.integers(0, CONFIG.vocab_size, 7 + 8 * i).tolist() for i in range(n)]


def run(model, prompts, prefill_attention, wise_config, swap=None, swap_decode=None, **kw):
    """Greedy tokens of each prompt, in two waves (the second finds the first's prefix cached)."""
    llm = torch_engine_with(prefill=prefill_attention)(model, wise_config=wise_config, num_pages=64, page_size=32,
                                                       max_num_seqs=4, max_model_len=256,
                                                       attention_backend="reference", **kw)
    if swap is not None:
        llm.runner.prefill_fn = swap
    if swap_decode is not None:
        llm.runner.dense_decode_fn = swap_decode
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    out = {}
    for wave in (prompts[:2], prompts[2:]):
        ids = {llm.add_request(p, params): p for p in wave}
        for o in llm.run_until_done(list(ids)):
            out[prompts.index(ids[o.request_id])] = o.token_ids
    assert llm.stats().prefix_cache_hits > 0 and llm.stats().prefill_attention == prefill_attention
    llm.close()
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])
@pytest.mark.parametrize("budget", [24, 8192], ids=["chunked", "whole"])
def test_engine_packed_prefill_gives_grouped_sdpa_tokens(model, wise_config, budget):
    prompts = shared_prompts()
    want = run(model, prompts, "sdpa", wise_config, max_num_batched_tokens=budget)
    assert run(model, prompts, "reference", wise_config, max_num_batched_tokens=budget) == want


def test_two_ranks_packed_prefill_gives_grouped_sdpa_tokens(model):
    """Tensor parallelism: each rank runs the packed call over its heads' pages."""
    prompts = shared_prompts(n=3)
    want = run(model, prompts, "sdpa", None, max_num_batched_tokens=24)
    assert run(model, prompts, "reference", None, max_num_batched_tokens=24, tensor_parallel_size=2) == want


# -- on an H200 -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fa4_prefill_equals_reference_on_gpu():
    """FA4 itself (bf16, page 128, GQA, chunks mid-page) against the float32 reference."""
    if fa4.import_error() is not None:
        pytest.skip(f"flash_attn.cute does not import: {fa4.import_error()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (40, 128, 2, 128)
    k_pages = torch.randn(shape, generator=g, device="cuda").bfloat16()
    v_pages = torch.randn(shape, generator=g, device="cuda").bfloat16()
    v = VarlenPrefill.build([(0, 300, [3, 9, 1]), (200, 77, [5, 6, 7]), (1000, 500, list(range(20, 32)))],
                            page_size=128, scratch_page=39, device="cuda")
    q = torch.randn(877, 16, 128, generator=g, device="cuda").bfloat16()
    out = fa4.prefill_attention_varlen(q, k_pages, v_pages, v)
    want = prefill_attention_varlen_reference(q, k_pages, v_pages, v)
    # bf16 output (8-bit mantissa: 2^-8 relative rounding) of O(1) values; FA4 rounds P to bf16
    # before P @ V: 2e-2 bounds both.
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("budget", [200, 8192], ids=["chunked", "whole"])
def test_engine_fa4_prefill_gives_sdpa_tokens_on_gpu(budget):
    """The built-in model in bf16: FA4 prefill (chunks of 200 tokens, most starting mid-page, or
    whole prompts) against grouped SDPA. The first tokens' logits agree within the bf16 bound of
    the model; a differing token must be a near tie of SDPA's logits (top-2 gap within it)."""
    if fa4.import_error() is not None:
        pytest.skip(f"flash_attn.cute does not import: {fa4.import_error()}")
    import wise_torch
    from wise_core import rounding
    from wise_core.checkpoint import TRAINED_MODEL
    model = wise_torch.load_model(TRAINED_MODEL, dtype=torch.bfloat16, device="cuda")
    g = np.random.default_rng(0)
    prompts = [g.integers(0, model.config.vocab_size, n).tolist() for n in (300, 129, 700, 77)]

    def run(arm):   # "auto" runs FA4 prefill where it imports, "triton" SDPA; both the Triton decode kernel
        llm = wise_torch.LLM(model, num_pages=64, page_size=128, max_num_seqs=4, max_model_len=1024,
                             max_num_batched_tokens=budget, attention_backend="auto" if arm == "fa4" else "triton")
        assert llm.stats().prefill_attention == arm
        ids = [llm.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True), keep_logits=True) for p in prompts]
        seqs = [llm.sequences[i] for i in ids]
        out = {o.request_id: o.token_ids for o in llm.run_until_done(ids)}
        return [out[i] for i in ids], [[t.float().cpu() for t in s.logits] for s in seqs]

    (got, got_logits), (want, want_logits) = run("fa4"), run("sdpa")
    for prompt, a, b, tokens, want_tokens in zip(prompts, got_logits, want_logits, got, want):
        diff, bound = rounding.model_difference(a[0], b[0], model.config, keys=len(prompt), dtype="bfloat16")
        assert diff <= bound, (len(prompt), diff, bound)
        if tokens != want_tokens:
            j = next(i for i, (x, y) in enumerate(zip(tokens, want_tokens)) if x != y)
            top2 = torch.topk(b[j], 2).values
            gap = float(top2[0] - top2[1])
            assert gap <= bound, f"prompt of {len(prompt)}: token {j} differs with a top-2 gap {gap} > {bound}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_fa4_dense_decode_gives_triton_tokens_on_gpu():
    """The built-in model in bf16, CUDA graphs on: dense decode through FA4 gives the Triton
    kernel's tokens."""
    if fa4.import_error() is not None:
        pytest.skip(f"flash_attn.cute does not import: {fa4.import_error()}")
    import wise_torch
    from wise_core.checkpoint import TRAINED_MODEL
    model = wise_torch.load_model(TRAINED_MODEL, dtype=torch.bfloat16, device="cuda")
    g = np.random.default_rng(1)
    prompts = [g.integers(0, model.config.vocab_size, n).tolist() for n in (300, 129, 700, 77)]

    def run_decode(dense_decode):   # SDPA prefill either way
        llm = torch_engine_with(dense_decode=dense_decode)(model, num_pages=64, page_size=128, max_num_seqs=4,
                                                           max_model_len=1024, attention_backend="triton")
        ids = [llm.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in prompts]
        out = {o.request_id: o.token_ids for o in llm.run_until_done(ids)}
        assert llm.runner.use_graphs and llm.runner.graphs
        return [out[i] for i in ids]

    assert run_decode("fa4") == run_decode("kernel")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fa4_reads_no_value_past_a_rows_keys_on_gpu():
    """NaN in every slot that is not one of a row's keys (a reused page's stale slots, the
    scratch page) changes no output of FA4's packed prefill nor of its paged decode, bitwise:
    the FA4 arms rely on the library for pages freed before a NaN is seen (docs/DESIGN.md)."""
    if fa4.import_error() is not None:
        pytest.skip(f"flash_attn.cute does not import: {fa4.import_error()}")
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (40, 128, 2, 128)
    k_pages, v_pages = (torch.randn(shape, generator=g, device="cuda").bfloat16() for _ in range(2))
    v = VarlenPrefill.build([(0, 300, [3, 9, 1]), (200, 77, [5, 6, 7]), (1000, 500, list(range(20, 32)))],
                            page_size=128, scratch_page=39, device="cuda")
    held = torch.from_numpy(held_slots(v.page_table.cpu(), v.seqused_k.cpu(), 40, 128)).cuda()[..., None, None]
    stale = [x.masked_fill(~held, float("nan")) for x in (k_pages, v_pages)]
    q = torch.randn(877, 16, 128, generator=g, device="cuda").bfloat16()
    assert torch.equal(fa4.prefill_attention_varlen(q, *stale, v), fa4.prefill_attention_varlen(q, k_pages, v_pages, v))
    q = torch.randn(3, 16, 128, generator=g, device="cuda").bfloat16()
    assert torch.equal(fa4.decode_attention_dense(q, *stale, v.page_table, v.seqused_k),
                       fa4.decode_attention_dense(q, k_pages, v_pages, v.page_table, v.seqused_k))
