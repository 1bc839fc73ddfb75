"""The serving engine of both frameworks on Huginn (test-tiny-huginn with random weights, fp32,
reference kernel, CPU), one test per behaviour run once per framework: requests joining between
steps, chunked prefill, preemption with offload, an abort and a cached prompt prefix each give
a request the greedy tokens of its prompt decoded alone through the model's own prefill and
decode_step (`parity.huginn`, the same seeded initial state of each position), dense and with
WISE over the core iterations; the pool's planes follow num_steps, and WISE depths past it and
a bad num_steps are refused, and an Ouro model runs its loops every step. A checkpoint directory
loads by path and serves the tokens of the model built from its tensors; huginn-0125's head_dim
(96) decodes on the framework's GPU kernel (interpreted on a CPU) with the reference kernel's
tokens. With per-token adaptive depth (`adaptive_depth`) requests joining between steps and
preempted ones get the tokens and exit depths of their prompt decoded alone with the same
`AdaptiveDepth`, and mean_decode_depth is the mean of those depths. Each framework's own cases:
tests/wise_torch/test_torch_engine_huginn.py, tests/wise_jax/test_jax_engine_huginn.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cases import prompts_of
from engine_cases import FRAMEWORKS, Framework, drained
from huginn_cases import checkpoint
from parity.huginn import jax_generate, torch_generate
from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.config_error import ConfigError
from wise_core.huginn_reference import num_planes
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams
from wise_core.speculative_config import SpeculativeConfig
from wise_core.wise_config import WiseConfig
from wise_torch.engine.llm import check_regroup

CONFIG = PRESETS["test-tiny-huginn"]
STEPS = 3           # core iterations of these engines (the preset's default is 4)
PAGE = 32
WISE = WiseConfig(discover_depths=(0,), reuse_depths=(1, 2), eta=0.5)
MODES = pytest.mark.parametrize("wise_config", [None, WISE], ids=["dense", "wise"])
# Every test runs these prompts (or some of them) for NEW tokens each: their reference runs are
# made once per framework and mode, and few shapes are compiled (JAX).
PROMPTS = prompts_of([60, 3, 28, 50], CONFIG.vocab_size, seed=1)   # 60 and 28 grow into a new page
NEW = 12
ADAPTIVE = AdaptiveDepth(threshold=0.42)
"""Among the KLs of this random model's successive iterations (about 0.3 to 0.7, none of its
checks here within 1e-3 of 0.42 in fp32): tokens exit after 1, 2 or all 3 iterations."""


@pytest.fixture(scope="module", params=FRAMEWORKS)
def fw(request):
    return Framework(request.param, CONFIG, seed=0)


def engine(fw, wise_config=None, **kw):
    kw = {"num_pages": 64, "page_size": PAGE, "max_num_seqs": 8, "max_model_len": 256, "attention_backend": "reference",
          "num_steps": STEPS, **kw}
    return fw.engine(wise_config=wise_config, **kw)


def alone(fw, prompt: list[int], wise_config, n: int = NEW, adaptive: AdaptiveDepth | None = None) -> list[int]:
    """n greedy tokens of `prompt` alone (memoized per framework): the model's prefill, then its
    decode_step one token a step, STEPS core iterations (adaptive: with that adaptive depth),
    the initial state of seed 0 (the engine's), in 3 pages (the longest prompt and its tokens:
    72 keys)."""
    return alone_run(fw, prompt, wise_config, n, adaptive)[0]


def alone_run(fw, prompt: list[int], wise_config, n: int = NEW, adaptive: AdaptiveDepth | None = None
              ) -> tuple[list[int], list[int]]:
    """`alone`'s tokens and the core iterations each of its n - 1 decode steps ran."""
    done = fw.__dict__.setdefault("huginn_alone", {})
    key = (tuple(prompt), n, wise_config, adaptive)
    if key not in done:
        depths = None if adaptive is None else [[]]
        # pages=3: every prompt's decode the same program (JAX)
        run = model_generate(fw, prompt, max_new_tokens=n, num_steps=STEPS, wise_config=wise_config, pages=3,
                             adaptive=adaptive, depths=depths)
        done[key] = run[0][0], None if depths is None else depths[0]
    return done[key]


def model_generate(fw, prompt: list[int], **settings):
    """`parity.huginn`'s greedy run of `prompt` alone on fw's model through its own prefill and
    decode_step (`torch_generate` / `jax_generate`, with their `settings`)."""
    if fw.name == "torch":
        return torch_generate(fw.model, [prompt], **settings)
    return jax_generate(fw.model, fw.config, [prompt], **settings)


def pool_planes(fw, llm) -> int:
    """The planes of the engine's K/V pool."""
    return (llm.runner.cache if fw.name == "torch" else llm.cache).k.shape[0]


@MODES
def test_requests_joining_between_steps_get_their_tokens_alone(fw, wise_config):
    llm = engine(fw, wise_config, max_num_batched_tokens=32)   # the longer prompts prefill in chunks
    ids, produced, step = {}, {}, 0
    while len(ids) < len(PROMPTS) or llm.has_unfinished():
        if step % 3 == 0 and len(ids) < len(PROMPTS):           # a new request every third step
            i = len(ids)
            ids[llm.add_request(PROMPTS[i], SamplingParams(max_tokens=NEW, ignore_eos=True))] = i
        for out in llm.step():
            produced[ids[out.request_id]] = out
        step += 1
    for i, prompt in enumerate(PROMPTS):
        assert produced[i].finished and produced[i].finish_reason == "length"
        assert produced[i].token_ids == alone(fw, prompt, wise_config)
    stats = drained(llm)
    assert stats.preemptions == 0
    if wise_config is not None:   # the reuse iterations attend fewer blocks than dense
        assert stats.fallbacks == 0 and all(0 < stats.density[d] < 1 for d in (1, 2)), stats.density


@MODES
def test_a_prompt_longer_than_a_step_prefills_in_chunks_with_the_unchunked_tokens(fw, wise_config):
    """60 prompt tokens at 24 a step: three chunks, the later two starting mid-page."""
    llm = engine(fw, wise_config, max_num_batched_tokens=24)
    rid = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=NEW, ignore_eos=True))
    seq, cached = llm.sequences[rid], []
    while not seq.prefilled:
        llm.step()
        cached.append(seq.num_cached)
    assert cached == [24, 48, 60]
    assert llm.run_until_done([rid])[0].token_ids == alone(fw, PROMPTS[0], wise_config)
    drained(llm)


@MODES
def test_preemption_offloads_and_resumes_with_the_same_tokens(fw, wise_config):
    llm = engine(fw, wise_config, num_pages=6)   # 6 pages of 32 hold the prompts, not the 8 pages they grow to
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    stats = drained(llm)
    assert stats.preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == alone(fw, prompt, wise_config)
    if wise_config is not None:
        assert stats.fallbacks == 0


@MODES
def test_abort_frees_pages_and_leaves_the_others_unchanged(fw, wise_config):
    llm = engine(fw, wise_config)
    ids = [llm.add_request(p, SamplingParams(max_tokens=NEW, ignore_eos=True)) for p in PROMPTS]
    for _ in range(4):
        llm.step()
    held = llm.stats().free_pages
    out = llm.abort(ids[3])
    assert out.finished and out.finish_reason == "abort"
    assert llm.stats().free_pages == held + 2             # 50 prompt + at most 4 new keys in pages of 32
    kept = [0, 1, 2]
    finals = llm.run_until_done([ids[i] for i in kept])
    for i, final in zip(kept, finals):
        assert final.token_ids == alone(fw, PROMPTS[i], wise_config)
    drained(llm)


def test_a_cached_prompt_prefix_gives_the_tokens_alone(fw):
    """A request whose first two pages of prompt a finished one holds (prefix caching, on by
    default) skips their prefill: their K/V hold each position's own initial state's."""
    prefix = prompts_of([64], CONFIG.vocab_size, seed=7)[0]
    prompts = [prefix + tail for tail in prompts_of([3, 14], CONFIG.vocab_size, seed=8)]
    llm = engine(fw)
    for prompt in prompts:   # one after the other: the second finds the first's pages
        rid = llm.add_request(prompt, SamplingParams(max_tokens=NEW, ignore_eos=True))
        assert llm.run_until_done([rid])[0].token_ids == alone(fw, prompt, None)
    assert drained(llm).prefix_cache_hits == 64


def test_the_pool_holds_the_planes_of_num_steps_and_wise_depths_are_checked_against_them(fw):
    for steps in (STEPS, 5, None):    # None: the config's total_ut_steps
        assert pool_planes(fw, engine(fw, num_steps=steps)) == num_planes(CONFIG, steps or CONFIG.total_ut_steps)
    with pytest.raises(ConfigError, match=r"WISE depths \[3\] are out of range for num_steps=3 core iterations"):
        engine(fw, dataclasses.replace(WISE, reuse_depths=(1, 3)))
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match=f"num_steps must be a non-negative integer, got {bad}"):
            engine(fw, num_steps=bad)


def test_an_ouro_model_runs_its_loops_every_step(fw):
    ouro = Framework(fw.name, PRESETS["test-tiny"], seed=0)
    with pytest.raises(ValueError, match=r"an Ouro model runs its 4 loops every step, got num_steps=3"):
        ouro.engine(num_pages=4, page_size=PAGE, num_steps=3)
    assert pool_planes(ouro, ouro.engine(num_pages=4, page_size=PAGE, num_steps=4)) == 4 * 2


def test_a_huginn_checkpoint_directory_serves_the_tokens_of_its_tensors(fw, tmp_path):
    ckpt = checkpoint(tmp_path)
    prompt = prompts_of([37], CONFIG.vocab_size, seed=7)[0]
    llm = fw.engine_at(tmp_path / "ckpt", num_steps=2, num_pages=8, page_size=PAGE, max_model_len=64, max_num_seqs=2,
                       attention_backend="reference")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    built = Framework(fw.name, CONFIG, tensors=ckpt.tensors)
    assert out.token_ids == model_generate(built, prompt, max_new_tokens=6, num_steps=2)[0][0]


HEAD_DIM_96 = dataclasses.replace(CONFIG, hidden_size=192, head_dim=96)
"""test-tiny-huginn with huginn-0125's head_dim (2 heads of 96): the GPU kernels run 128-lane tiles."""
GPU_KERNEL = {"torch": "triton", "jax": "pallas"}


def decode_kernel(fw, llm) -> str:
    """The kernel fw's engine decodes with (torch: read from the module of its attention function)."""
    if fw.name == "jax":
        return llm.kernel
    attention = next(iter(llm.runner.attention.values()))
    return {"wise_torch.attention": "reference", "wise_torch.kernels.triton_decode": "triton"}[
        getattr(attention, "func", attention).__module__]


@pytest.mark.parametrize("wise_config", [None, WiseConfig(block_size=16, eta=0.8, discover_depths=(0,),
                                                          reuse_depths=(1,))], ids=["dense", "wise"])
def test_head_dim_96_on_the_gpu_kernel_gives_the_reference_kernels_tokens(fw, wise_config):
    """LLM(attention_backend="triton" / "pallas") on a Huginn of head_dim 96 (interpreted on a CPU) decodes
    on that kernel, not the reference, and gives the reference kernel's greedy tokens, dense and
    WISE (sparse: the reuse iteration attends fewer blocks than dense)."""
    if fw.name == "torch" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs Triton")
    model = Framework(fw.name, HEAD_DIM_96, seed=3)
    prompts = prompts_of([40, 20], HEAD_DIM_96.vocab_size, seed=9)
    tokens, stats = {}, {}
    for kernel in ("reference", GPU_KERNEL[fw.name]):
        llm = model.engine(wise_config=wise_config, num_steps=2, num_pages=8, page_size=PAGE, max_model_len=64,
                           max_num_seqs=2, attention_backend=kernel)
        assert decode_kernel(model, llm) == kernel
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        tokens[kernel], stats[kernel] = [o.token_ids for o in outs], llm.stats()
    gpu = GPU_KERNEL[fw.name]
    assert tokens[gpu] == tokens["reference"]
    if wise_config is not None:
        assert stats[gpu].fallbacks == 0 and 0 < stats[gpu].density[1] < 1, stats[gpu].density


# The JAX adaptive-depth cases run in a process of their own (`test_adaptive_depth_jax_cases_run_
# in_their_own_process`), as tests/wise_core/test_huginn_adaptive.py's do: they compile many
# adaptive decode programs, and inside a whole-suite process XLA's CPU compiler (jax 0.10.2) has
# crashed compiling such a step.
ADAPTIVE_JAX_PROCESS = os.environ.get("WISE_HUGINN_ENGINE_ADAPTIVE_JAX") == "1"


def test_adaptive_depth_jax_cases_run_in_their_own_process():
    if ADAPTIVE_JAX_PROCESS:
        pytest.skip("this is the JAX adaptive-depth process")
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                           "-k", "adaptive and jax"], cwd=root, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, WISE_HUGINN_ENGINE_ADAPTIVE_JAX="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4 passed, 1 skipped" in done.stdout, done.stdout[-1000:]   # the 4 JAX cases; this test skipped


def adaptive_case(fw):
    """Skip a JAX adaptive-depth case outside its own process."""
    if fw.name == "jax" and not ADAPTIVE_JAX_PROCESS:
        pytest.skip("runs in test_adaptive_depth_jax_cases_run_in_their_own_process")


def check_adaptive(fw, outs: dict[int, list[int]], stats, wise_config) -> None:
    """Each prompt i's tokens outs[i] are its tokens alone with ADAPTIVE, whose decode steps
    exit at different depths, and stats.mean_decode_depth is the mean of those depths."""
    ran = []
    for i, tokens in outs.items():
        want, depths = alone_run(fw, PROMPTS[i], wise_config, adaptive=ADAPTIVE)
        assert tokens == want, i
        ran += depths
    assert min(ran) < STEPS and len(set(ran)) > 1, ran       # rows exit, at different depths
    assert stats.mean_decode_depth == sum(ran) / len(ran)    # integer counts: exact


def joining(llm) -> dict[int, list[int]]:
    """PROMPTS through llm, a new request every third step -> each prompt's tokens, by index."""
    ids, produced, step = {}, {}, 0
    while len(ids) < len(PROMPTS) or llm.has_unfinished():
        if step % 3 == 0 and len(ids) < len(PROMPTS):
            i = len(ids)
            ids[llm.add_request(PROMPTS[i], SamplingParams(max_tokens=NEW, ignore_eos=True))] = i
        for out in llm.step():
            produced[ids[out.request_id]] = out
        step += 1
    assert all(out.finished and out.finish_reason == "length" for out in produced.values())
    return {i: out.token_ids for i, out in produced.items()}


@MODES
def test_adaptive_depth_requests_joining_between_steps_get_their_tokens_and_depths_alone(fw, wise_config):
    adaptive_case(fw)
    llm = engine(fw, wise_config, adaptive_depth=ADAPTIVE)
    outs = joining(llm)
    stats = drained(llm)
    check_adaptive(fw, outs, stats, wise_config)
    llm.reset_stats()
    assert llm.stats().mean_decode_depth is None


def test_adaptive_depth_preemption_resumes_with_the_same_tokens_and_depths(fw):
    adaptive_case(fw)
    llm = engine(fw, adaptive_depth=ADAPTIVE, num_pages=6)   # as test_preemption_offloads_...
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    stats = drained(llm)
    assert stats.preemptions > 0
    check_adaptive(fw, {i: out.token_ids for i, out in enumerate(outs)}, stats, None)


def test_adaptive_depth_is_refused_where_it_does_not_apply(fw):
    adaptive_case(fw)
    with pytest.raises(TypeError, match="adaptive_depth must be an AdaptiveDepth or None, got float"):
        engine(fw, adaptive_depth=0.42)
    ouro = Framework(fw.name, PRESETS["test-tiny"], seed=0)
    with pytest.raises(ValueError, match=r"adaptive_depth runs Huginn models; this ouro model exits by its "
                                         r"config's early_exit_threshold \(1.0\)"):
        ouro.engine(num_pages=8, page_size=PAGE, max_num_seqs=2, max_model_len=64, adaptive_depth=ADAPTIVE)
    if fw.name == "torch":   # no speculation on Huginn, adaptive or not
        with pytest.raises(ValueError, match="speculative decoding and tensor parallelism run Ouro models only"):
            engine(fw, adaptive_depth=ADAPTIVE, speculative_config=SpeculativeConfig())


# Regrouping by depth (`adaptive_regroup`) is the torch engine's only (JAX's steps are compiled
# with static shapes): these tests run outside the per-framework fixture.
@pytest.fixture(scope="module")
def torch_fw():
    return Framework("torch", CONFIG, seed=0)


def test_regrouped_adaptive_depth_gives_each_request_its_tokens_and_depths_alone(torch_fw, monkeypatch):
    """Requests joining between steps and preempted ones, regrouped: each decode step runs
    `run_regrouped` (rows that exit leave the group), and every prompt gets the tokens and
    exit depths of its prompt decoded alone (riding along there), mean_decode_depth their mean."""
    fw, calls = torch_fw, {"decode_step": 0, "run_regrouped": 0}
    for name in calls:
        method = getattr(fw.model, name)
        monkeypatch.setattr(fw.model, name, lambda *a, _m=method, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1)
                            or _m(*a, **k))
    llm = engine(fw, adaptive_depth=ADAPTIVE, adaptive_regroup=True)
    outs = joining(llm)
    stats = drained(llm)
    assert calls["run_regrouped"] == calls["decode_step"] > 0, calls
    check_adaptive(fw, outs, stats, None)
    llm = engine(fw, adaptive_depth=ADAPTIVE, adaptive_regroup=True, num_pages=6)   # as test_preemption_...
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    stats = drained(llm)
    assert stats.preemptions > 0
    check_adaptive(fw, dict(enumerate(o.token_ids for o in outs)), stats, None)


def test_regrouped_adaptive_depth_is_refused_where_it_cannot_run(torch_fw):
    fw = torch_fw
    with pytest.raises(ValueError, match="adaptive_regroup must be True or False, got 1"):
        engine(fw, adaptive_depth=ADAPTIVE, adaptive_regroup=1)
    with pytest.raises(ValueError, match="adaptive_regroup regroups the rows of adaptive depth; pass adaptive_depth"):
        engine(fw, adaptive_regroup=True)
    with pytest.raises(ValueError, match=r"adaptive_regroup runs without WISE .*pass wise_config=None"):
        engine(fw, WISE, adaptive_depth=ADAPTIVE, adaptive_regroup=True)
    with pytest.raises(ValueError, match="speculative decoding and tensor parallelism run Ouro models only"):
        engine(fw, adaptive_depth=ADAPTIVE, adaptive_regroup=True, speculative_config=SpeculativeConfig())
    with pytest.raises(ValueError, match="speculative decoding and tensor parallelism run Ouro models only"):
        engine(fw, adaptive_depth=ADAPTIVE, adaptive_regroup=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):   # on CPU
        engine(fw, adaptive_depth=ADAPTIVE, adaptive_regroup=True, cuda_graphs=True)
    for cuda_graphs in (True, "auto"):   # LLM's check where the step would be captured (a CUDA model)
        with pytest.raises(ValueError, match=rf"cannot run in a CUDA graph \(cuda_graphs={cuda_graphs!r} on "
                                             rf"CUDA\); pass cuda_graphs=False"):
            check_regroup(True, ADAPTIVE, None, True, cuda_graphs)
    check_regroup(True, ADAPTIVE, None, False, False)   # eager: runs


@pytest.mark.parametrize("budget", [32, 8192], ids=["chunked", "whole"])
def test_prompt_logprobs_are_the_forward_log_softmax(fw, budget):
    """prompt_logprobs of a Huginn request (chunked or whole prompt) are the log-softmax of the
    model's full forward at STEPS iterations from the seed-0 state of each position."""
    import numpy as np
    prompt = PROMPTS[0]
    if fw.name == "torch":
        with torch.no_grad():
            logits = fw.model(torch.tensor([prompt]), num_steps=STEPS)[0].double().numpy()
    else:
        from wise_jax import huginn
        logits = np.asarray(huginn.forward(fw.model, fw.config, [prompt], num_steps=STEPS)[0], np.float64)
    want = logits - logits.max(-1, keepdims=True)
    want = want - np.log(np.exp(want).sum(-1, keepdims=True))
    llm = engine(fw, max_num_batched_tokens=budget)
    [out] = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = prompt[pos]
        # fp32 engine against the same fp32 model's forward, summed in other orders over
        # 1 + 3 x 3 + 2 sublayers of <= 60 keys: well under 1e-4 in log-probability.
        assert abs(entry[token].logprob - want[pos - 1, token]) < 1e-4, pos
        by_rank = {lp.rank: t for t, lp in entry.items()}
        assert [by_rank[1], by_rank[2]] == np.argsort(-want[pos - 1])[:2].tolist(), pos   # the top 2
    drained(llm)
