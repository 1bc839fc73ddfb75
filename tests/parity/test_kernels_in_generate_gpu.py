"""The GPU kernels end to end on the built-in model (run on the H200; skipped elsewhere):
WISE with the Triton kernel against the torch reference kernel, and the Pallas kernel in bf16
decode against the jnp reference, through the public generate / teacher_force.

Comparisons use parity.checks.compare_runs, the suite's one end-to-end comparison: logits (or
teacher-forced log-probs) within `wise_core.rounding.network_bound` of the model's depth, width
and dtype, and the same greedy tokens except where the two runs part on a near-tie (top-2 logit
gap within twice the bound), logits compared up to that point. Plus, for Triton: each discovery
call's support is select_blocks of its own masses, at Ouro's head shape and 4K keys."""

from __future__ import annotations

import numpy as np
import pytest

from parity.checks import compare_runs, support_differences
from parity.suite import Generated
from wise_core import modes as M
from wise_core import reference as ref
from wise_core.checkpoint import DEFAULT_MODEL
from wise_core.wise_config import WiseConfig

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = (300, 1100, 1900, 640)  # 10-60 blocks of 32 keys
NEW = 32


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(vocab, 256), n).tolist() for n in LENGTHS]


def _generated(out) -> Generated:
    return Generated(out.tokens, [np.asarray(x, np.float32) for x in out.logits])


def _forced(out, continuations) -> Generated:
    return Generated(continuations, [np.asarray(x, np.float32) for x in out.logprobs])


@cuda
@pytest.mark.parametrize("wise", [None, WiseConfig(eta=0.9)], ids=["dense", "wise"])
def test_triton_generate_matches_the_reference_kernel_fp32(wise):
    import wise_torch

    model = wise_torch.load_model(DEFAULT_MODEL, device="cuda")
    prompts = _prompts(model.config.vocab_size)
    runs = {kernel: wise_torch.generate(model, prompts, max_new_tokens=NEW, eos_token_id=None, return_logits=True,
                                        wise_config=wise, attention_backend=kernel)
            for kernel in ("triton", "reference")}
    result = compare_runs(model.config, _generated(runs["triton"]), _generated(runs["reference"]), "float32",
                          forced=False)
    assert result.passed, result.detail
    assert sum(map(len, runs["triton"].tokens)) == NEW * len(LENGTHS)
    if wise is not None:
        assert runs["triton"].stats.fallbacks == runs["reference"].stats.fallbacks == 0
        assert all(d < 1.0 for d in runs["triton"].stats.density.values())  # a real selection


@cuda
def test_triton_bf16_teacher_forced_matches_the_reference_kernel():
    import wise_torch

    model = wise_torch.load_model(DEFAULT_MODEL, dtype="bfloat16", device="cuda")
    contexts = _prompts(model.config.vocab_size)
    continuations = _prompts(model.config.vocab_size, seed=2)
    continuations = [c[:NEW] for c in continuations]
    for wise in (None, WiseConfig(eta=0.9)):
        runs = {kernel: wise_torch.teacher_force(model, contexts, continuations, wise_config=wise,
                                                 attention_backend=kernel)
                for kernel in ("triton", "reference")}
        result = compare_runs(model.config, _forced(runs["triton"], continuations),
                              _forced(runs["reference"], continuations), "bfloat16", forced=True)
        assert result.passed, f"{'wise' if wise else 'dense'}: {result.detail}"


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_selection_is_select_blocks_of_its_own_masses(dtype):
    """Ouro's attention shape (16 heads of 128) over 4K keys: DISCOVER rows select
    select_blocks(mass) of the mass they return, DISCOVER_UNION rows OR it into the held support,
    except where `rounding.selection_margin` lets the summation order decide."""
    from wise_torch.kernels.triton_decode import decode_attention

    eta, block, page = 0.9, 32, 128
    lens = [4096, 3001, 1500, 64, 2048, 777]
    gen = torch.Generator().manual_seed(3)
    batch, heads, dim = len(lens), 16, 128
    max_pages = 4096 // page
    num_pages = batch * max_pages
    table = torch.randperm(num_pages, generator=gen).reshape(batch, max_pages).to(torch.int32)
    dt = getattr(torch, dtype)
    k = torch.randn(num_pages, page, heads, dim, generator=gen).to("cuda", dt)
    v = torch.randn(num_pages, page, heads, dim, generator=gen).to("cuda", dt)
    q = (3 * torch.randn(batch, heads, dim, generator=gen)).to("cuda", dt)  # peaked softmax
    held = torch.rand(batch, heads, max_pages * page // block, generator=gen) < 0.1
    modes = torch.tensor([M.DISCOVER, M.DISCOVER_UNION] * 3, dtype=torch.int32)
    _, support, mass = decode_attention(q, k, v, table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                        modes.cuda(), held.clone().cuda(), block_size=block, eta=eta,
                                        return_mass=True)
    support, mass, held = support.cpu().numpy(), mass.cpu().numpy(), held.numpy()
    strict = 0
    for b in range(batch):
        want = ref.select_blocks(mass[b], eta) | (held[b] if modes[b] == M.DISCOVER_UNION else False)
        found = support_differences(mass[b], eta, support[b], want)
        assert all(d.explained for d in found), "; ".join(d.describe() for d in found if not d.explained)
        strict += int((ref.select_blocks(mass[b], eta) < (mass[b] > 0)).any())
    assert strict >= batch // 2  # the selections are not all-blocks


def _jax_gpu() -> bool:
    try:
        import jax
        return bool(jax.devices("gpu"))
    except (ImportError, RuntimeError):
        return False


@pytest.mark.skipif(not _jax_gpu(), reason="needs a CUDA GPU for jax")
@pytest.mark.parametrize("wise", [None, WiseConfig(eta=0.9)], ids=["dense", "wise"])
def test_pallas_bf16_decode_matches_the_jnp_reference(wise):
    """bf16 weights and cache: greedy generation, and teacher-forced log-probs of the same
    tokens (decode steps of generate, so every decode-attention call runs in bf16)."""
    import wise_jax

    config, params = wise_jax.load_model(DEFAULT_MODEL, dtype="bfloat16")
    prompts = _prompts(config.vocab_size)
    continuations = [c[:NEW] for c in _prompts(config.vocab_size, seed=2)]
    runs, forced = {}, {}
    for kernel in ("pallas", "reference"):
        runs[kernel] = wise_jax.generate(params, config, prompts, max_new_tokens=NEW, eos_token_id=None,
                                         return_logits=True, wise_config=wise, attention_backend=kernel)
        forced[kernel] = wise_jax.teacher_force(params, config, prompts, continuations, wise_config=wise,
                                                attention_backend=kernel)
    greedy = compare_runs(config, _generated(runs["pallas"]), _generated(runs["reference"]), "bfloat16",
                          forced=False)
    assert greedy.passed, greedy.detail
    scored = compare_runs(config, _forced(forced["pallas"], continuations), _forced(forced["reference"], continuations),
                          "bfloat16", forced=True)
    assert scored.passed, scored.detail
