"""wise_torch.LLM(tensor_parallel_size=2) on CPU: two processes over gloo, against the same engine
on one device.

Tolerances: the all-reduce adds the two ranks' fp32 partial sums of o_proj and down_proj, one
more rounding per sublayer than one device's GEMM, so logits agree within
`rounding.model_bound` (fp32) and greedy tokens are equal. Each TP engine spawns one worker
process (a few seconds to import torch there), so the tests share few engines."""

import pytest
import torch

import wise_torch as wt
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig
from wise_torch import parallel
from cases import prompts_of

WISE = WiseConfig(eta=0.5)


@pytest.fixture(scope="module")
def model():
    config = PRESETS["test-tiny-gqa"]      # 4 query heads, 2 KV heads: one KV head and its 2 query heads a rank
    return wt.from_tensors(config, random_tensors(config, seed=0, std=0.08))


def run(llm, prompts, news, join_every=0, abort_preempted=False):
    """Step the engine over the prompts (a new one every `join_every` steps, 0: all at once) ->
    ({prompt index: RequestOutput}, kept logits per prompt index). abort_preempted: abort the
    first request found preempted with its K/V offloaded (it is left out of the outputs)."""
    ids, seqs, final, step, aborted = {}, {}, {}, 0, None
    while len(ids) < len(prompts) or llm.has_unfinished():
        while len(ids) < len(prompts) and (join_every == 0 or step % join_every == 0):
            i = len(ids)
            rid = llm.add_request(prompts[i], wt.SamplingParams(max_tokens=news[i], ignore_eos=True),
                                  keep_logits=True)
            ids[rid], seqs[i] = i, llm.sequences[rid]
            if join_every:
                break
        for out in llm.step():
            if out.finished:
                final[ids[out.request_id]] = out
        if abort_preempted and aborted is None:
            victim = next((s for s in llm.sequences.values() if s.offloaded is not None), None)
            if victim is not None:
                aborted = ids[victim.request_id]
                llm.abort(victim.request_id)
        step += 1
    return final, {i: torch.stack(s.logits) for i, s in seqs.items() if i in final}, aborted


def engine(model, wise_config, tp, **kw):
    kw = {"num_pages": 10, "page_size": 32, "max_num_seqs": 4, "max_model_len": 256, "attention_backend": "reference",
          "max_num_batched_tokens": 64, "seed": 0, **kw}
    return wt.LLM(model, wise_config=wise_config, tensor_parallel_size=tp, **kw)


@pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])
def test_two_ranks_give_the_single_device_tokens(model, wise_config):
    """Requests joining between steps, prompts prefilled in chunks of 64 tokens, a pool of 10
    pages that forces preemption (offload and restore on both ranks) and, with WISE, the
    abort of a preempted request (both ranks drop its offloaded K/V)."""
    prompts = prompts_of([70, 3, 129, 40, 17, 60], model.config.vocab_size)
    news = [30, 14, 25, 40, 8, 36]
    abort = wise_config is not None
    with engine(model, wise_config, 1) as llm:
        want, want_logits, aborted = run(llm, prompts, news, join_every=2, abort_preempted=abort)
        want_stats = llm.stats()
    with engine(model, wise_config, 2) as llm:
        assert llm.runner.cache.k.shape[3] == 1 and llm.model.config.num_attention_heads == 2  # rank 0's heads
        got, got_logits, got_aborted = run(llm, prompts, news, join_every=2, abort_preempted=abort)
        stats = llm.stats()
        if wise_config is None:      # a rank that dies stops the engine with a named error, not a hang
            llm.workers.processes[0].kill()
            llm.workers.processes[0].join()
            llm.add_request(prompts[0], wt.SamplingParams(max_tokens=2))
            with pytest.raises(RuntimeError, match="tensor-parallel rank 1 has exited"):
                llm.step()
    assert want_stats.preemptions > 0 and stats.preemptions == want_stats.preemptions
    assert aborted == got_aborted and (aborted is not None) == abort
    assert sorted(got) == sorted(want) and len(want) == len(prompts) - abort
    for i in want:
        assert got[i].token_ids == want[i].token_ids, i
        diff, bound = rounding.model_difference(got_logits[i], want_logits[i], model.config, keys=170)
        assert diff <= bound, (i, diff, bound)   # fp32: partial sums added by the all-reduce
    assert stats.free_pages == stats.total_pages == 10
    if wise_config is not None:
        # every rank counts its heads' blocks; the reduced density is the single device's
        assert stats.fallbacks == want_stats.fallbacks
        assert stats.density == pytest.approx(want_stats.density, abs=1e-3) and 0 < stats.density[2] < 1


@pytest.mark.parametrize("wise_config", [None, WiseConfig()], ids=["dense", "wise"])
def test_builtin_model_two_ranks_fp32(wise_config):
    model = wt.load_model("ouro-py-3m")
    texts = ("def fib(n):", "import os\nimport sys\n" * 12, "class Stack:\n    def push(self, x):")
    prompts = [model.tokenizer.encode(t).ids for t in texts]
    news = [24] * len(prompts)
    kw = dict(num_pages=16, page_size=64, max_num_seqs=4, max_model_len=512)
    with engine(model, wise_config, 1, **kw) as llm:
        want, want_logits, _ = run(llm, prompts, news)
        want_density = llm.stats().density
    with engine(model, wise_config, 2, **kw) as llm:
        got, got_logits, _ = run(llm, prompts, news)
        density = llm.stats().density
    for i in want:
        assert got[i].token_ids == want[i].token_ids, i
        diff, bound = rounding.model_difference(got_logits[i], want_logits[i], model.config, keys=230)
        assert diff <= bound, (i, diff, bound)   # fp32: partial sums added by the all-reduce
    if wise_config is not None:
        assert density == pytest.approx(want_density, abs=1e-3) and density[2] < 1


def test_fp8_pool_on_two_ranks_follows_the_single_device(model):
    """kv_cache_dtype="fp8" (WISE): each rank quantizes its KV head's K/V (a (token, KV head) scale
    is one rank's) and offloads and restores its codes and scales in the preemptions a pool of 6
    pages forces. The all-reduce's
    roundings may move a K/V value across an e4m3fn rounding decision, and the code it takes
    moves the logits far more than the all-reduce alone (~1e-6): so the logits, up to where the
    tokens part, lie within a tenth of the quantization's own effect on the prompt's first
    logits (fp8 against an unquantized pool, one device), and tokens part only at a near tie
    (a top-2 margin under twice that difference): rare, at most one prompt of the four."""
    prompts = prompts_of([70, 3, 129, 40], model.config.vocab_size)
    news = [30, 14, 25, 40]
    runs = {}
    for tp, dtype in ((1, "auto"), (1, "fp8"), (2, "fp8")):
        with engine(model, WISE, tp, num_pages=6, kv_cache_dtype=dtype) as llm:
            out, logits, _ = run(llm, prompts, news, join_every=2)
            runs[tp, dtype] = [out[i].token_ids for i in range(len(prompts))], logits
            if dtype == "fp8":
                assert llm.runner.cache.k_scale.shape[3] == 2 // tp and llm.stats().preemptions > 0
    (want, want_logits), (got, got_logits) = runs[1, "fp8"], runs[2, "fp8"]
    whole = 0
    for i in range(len(prompts)):
        n = next((j for j, (a, b) in enumerate(zip(want[i], got[i])) if a != b), len(want[i]))
        diff = (got_logits[i][:n + 1] - want_logits[i][:n + 1]).abs().amax(-1)    # rows of one context
        effect = (want_logits[i][0] - runs[1, "auto"][1][i][0]).abs().max()
        assert diff.max() <= 0.1 * effect, (i, diff.max(), effect)
        if n < len(want[i]):
            top = want_logits[i][n].topk(2).values
            assert top[0] - top[1] <= 2 * diff[n], (i, n, top, diff[n])
        whole += n == len(want[i])
    assert whole >= len(prompts) - 1


def test_two_ranks_score_the_prompt(model):
    """SamplingParams.prompt_logprobs with two ranks (prompts in chunks of 64 tokens): rank 0's
    scores are the single device's up to the all-reduce's roundings (fp32, one more per
    sublayer: ~1e-6 relative on logits of size ~1, far below the 1e-4 allowed on log p)."""
    prompts = prompts_of([100, 70], model.config.vocab_size)
    params = wt.SamplingParams(max_tokens=1, prompt_logprobs=2)
    outs = {}
    for tp in (1, 2):
        with engine(model, None, tp) as llm:
            outs[tp] = llm.generate(prompts, params, use_tqdm=False)
    for got, want in zip(outs[2], outs[1]):
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(got.prompt_token_ids)
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert list(a) == list(b) and [x.rank for x in a.values()] == [x.rank for x in b.values()]
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.values(), b.values())) < 1e-4


def test_shards_hold_their_heads_parts():
    """Each fused projection cut per part: rank r's q, k, v rows are those of its heads, its
    gate and up rows its MLP columns; o_proj and down_proj keep their input columns."""
    config = PRESETS["test-tiny-gqa"]
    full = wt.from_tensors(config, random_tensors(config, seed=1))
    hf = wt.to_checkpoint_tensors(full)
    d, size = config.head_dim, 2
    for name, t in full.state_dict().items():
        parts = [parallel.shard_tensor(name, t, config, r, size) for r in range(size)]
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        hf_of = lambda leaf: torch.from_numpy(hf[f"model.layers.{layer}.{leaf}"])  # noqa: E731
        if name.endswith("qkv_proj.weight"):
            q, k, v = (hf_of(f"self_attn.{p}_proj.weight") for p in "qkv")
            for r, part in enumerate(parts):
                assert torch.equal(part, torch.cat([q[r * 2 * d:(r + 1) * 2 * d], k[r * d:(r + 1) * d],
                                                    v[r * d:(r + 1) * d]]))
        elif name.endswith("gate_up_proj.weight"):
            gate, up, half = hf_of("mlp.gate_proj.weight"), hf_of("mlp.up_proj.weight"), config.intermediate_size // 2
            for r, part in enumerate(parts):
                assert torch.equal(part, torch.cat([gate[r * half:(r + 1) * half], up[r * half:(r + 1) * half]]))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), t) and parts[0].is_contiguous()
        else:
            assert all(p is t for p in parts)   # replicated
    local = parallel.local_config(config, size)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 128)


def test_bad_tensor_parallel_settings_are_named(model):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's "
                                         r"num_key_value_heads \(2\)"):
        engine(model, None, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        engine(model, None, 0)
    with pytest.raises(ValueError, match="speculative decoding does not run with tensor_parallel_size > 1"):
        engine(model, None, 2, speculative_config=SpeculativeConfig("loops", num_draft=2, draft_loops=2))
    with pytest.raises(RuntimeError, match="one rank's shard"):
        shard = wt.from_tensors(model.config, random_tensors(model.config, seed=0))
        shard.tp = parallel.TensorParallel(0, 2)
        shard(torch.zeros(1, 3, dtype=torch.int64))
