"""Inputs of the checks: paged decode-attention cases, selection masses, models and prompts.

Everything is numpy and seeded, so both frameworks see the same values. Low-precision inputs
are rounded once here (`round_to`), so the float64 specification sees exactly the values the
implementations receive.
"""

from __future__ import annotations

import dataclasses
import functools

import ml_dtypes
import numpy as np

from wise_core import modes as M
from wise_core import reference as ref
from wise_core import selection as rules
from wise_core.model_config import ModelConfig
from wise_core.presets import PRESETS

DTYPES = ("float32", "bfloat16")


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` (round to nearest even), returned as float32."""
    x = np.asarray(x, np.float32)
    if dtype == "float32":
        return x
    if dtype == "bfloat16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    raise ValueError(f"unsupported dtype {dtype!r} (choose from {DTYPES})")


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One paged decode-attention problem: a batch of rows with the given seq_lens, pages
    scattered over a shuffled pool. Page-table entries past a row's pages point at other rows'
    pages and keys past seq_len hold random values: both must be ignored."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    seq_lens: tuple[int, ...]
    page_size: int = 64
    block_size: int = 32
    eta: float = 0.95
    q_scale: float = 2.0  # > 1 makes the softmax peaked, so the selection is not all blocks
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def max_pages(self) -> int:
        return -(-max(self.seq_lens) // self.page_size)

    @property
    def max_blocks(self) -> int:
        return self.max_pages * self.page_size // self.block_size

    def causal(self) -> np.ndarray:
        """bool[batch, max_blocks]: blocks holding a key < seq_len."""
        return np.stack([ref.causal_blocks(n, self.block_size, self.max_blocks) for n in self.seq_lens])

    @functools.lru_cache(maxsize=None)
    def _float32_inputs(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        batch, max_pages = self.batch, self.max_pages
        num_pages = batch * max_pages + 2
        shape = (num_pages, self.page_size, self.kv_heads, self.head_dim)
        k, v = rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)
        q = self.q_scale * rng.standard_normal((batch, self.heads, self.head_dim), np.float32)
        page_table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
        for b, n in enumerate(self.seq_lens):
            used = -(-n // self.page_size)
            page_table[b, used:] = page_table[(b + 1) % batch, :max_pages - used]  # foreign pages
        causal = np.broadcast_to(self.causal()[:, None, :], (batch, self.heads, self.max_blocks))
        random = (rng.random(causal.shape) < 0.5) & causal
        first = rng.integers(0, np.maximum(causal.sum(-1), 1))  # one causal block each head keeps
        np.put_along_axis(random, first[..., None], True, axis=-1)
        return {"q": q, "k_pages": k, "v_pages": v, "page_table": page_table.astype(np.int32),
                "seq_lens": np.asarray(self.seq_lens, np.int32), "all_blocks": causal.copy(), "random": random,
                "garbage": rng.random(causal.shape) < 0.5}

    @functools.lru_cache(maxsize=None)
    def inputs(self, dtype: str) -> dict[str, np.ndarray]:
        """q [batch, heads, head_dim], k_pages / v_pages [num_pages, page_size, kv_heads, head_dim]
        (float32 holding `dtype` values), page_table int32[batch, max_pages], seq_lens int32[batch],
        and supports bool[batch, heads, max_blocks]: `all_blocks` (every causal block), `random`
        (about half the causal blocks, at least one per head), `garbage` (random bits). Read-only."""
        arrays = dict(self._float32_inputs())
        for name in ("q", "k_pages", "v_pages"):
            arrays[name] = round_to(arrays[name], dtype)
        for array in arrays.values():
            array.flags.writeable = False  # shared by every implementation: copy before writing
        return arrays

    def row_keys(self, dtype: str, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Row b's keys and values float64 [seq_len, kv_heads, head_dim], gathered through its pages."""
        x = self.inputs(dtype)
        pages = x["page_table"][b]
        n = self.seq_lens[b]
        k = x["k_pages"][pages].reshape(-1, self.kv_heads, self.head_dim)[:n]
        v = x["v_pages"][pages].reshape(-1, self.kv_heads, self.head_dim)[:n]
        return k.astype(np.float64), v.astype(np.float64)

    def spec(self, dtype: str, support: np.ndarray | None, modes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The float64 specification (`wise_core.reference.attention`) of a call: (out [batch,
        heads, head_dim], mass [batch, heads, max_blocks]); SPARSE rows attend `support`."""
        x = self.inputs(dtype)
        out = np.zeros((self.batch, self.heads, self.head_dim))
        mass = np.zeros((self.batch, self.heads, self.max_blocks))
        for b, n in enumerate(self.seq_lens):
            k, v = self.row_keys(dtype, b)
            n_blocks = ref.num_blocks(n, self.block_size)
            row_support = support[b, :, :n_blocks] if modes[b] == M.SPARSE else None
            out[b], mass[b, :, :n_blocks] = ref.attention(x["q"][b].astype(np.float64), k, v,
                                                          block_size=self.block_size, support=row_support)
        return out, mass


def attention_cases(quick: bool) -> tuple[AttentionCase, ...]:
    """MHA and GQA cases: tiny on CPU (interpreted kernels), Ouro-sized heads and long contexts
    otherwise. Sequence lengths cover 1 key, partial and full blocks and pages."""
    if quick:
        lens = (1, 33, 97, 160)
        return (AttentionCase("mha-h2-d64", heads=2, kv_heads=2, head_dim=64, seq_lens=lens, seed=1),
                AttentionCase("gqa-h4-kv2-d32", heads=4, kv_heads=2, head_dim=32, seq_lens=lens, seed=2))
    lens = (1, 31, 300, 1024, 1500, 2048, 3001, 4096)
    return (AttentionCase("ouro-mha-h16-d128", heads=16, kv_heads=16, head_dim=128, seq_lens=lens,
                          page_size=128, seed=1),
            AttentionCase("gqa-h16-kv4-d128", heads=16, kv_heads=4, head_dim=128, seq_lens=lens,
                          page_size=128, seed=2))


# -- selection masses -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SelectionCase:
    """mass float32[rows, n_blocks] (non-negative) and eta."""

    name: str
    mass: np.ndarray
    eta: float


def selection_cases(seed: int = 0) -> list[SelectionCase]:
    """Random masses (Dirichlet and heavy-tailed, several widths and etas) and adversarial ones:
    exact ties, zeros, eta = 1, a single block, prefix sums landing on the threshold, extreme
    magnitudes, subnormals (which the rule counts as zero)."""
    rng = np.random.default_rng(seed)
    f32 = functools.partial(np.asarray, dtype=np.float32)
    cases = []
    for n, eta in ((1, 0.95), (6, 0.95), (24, 0.5), (128, 0.95), (128, 1.0), (1024, 0.9)):
        cases.append(SelectionCase(f"dirichlet-n{n}-eta{eta}", f32(rng.dirichlet(np.full(n, 0.3), 16)), eta))
    heavy = rng.pareto(1.0, (16, 64)) * (rng.random((16, 64)) < 0.7)
    cases.append(SelectionCase("heavy-tailed-n64", f32(heavy), 0.95))
    cases += [
        SelectionCase("all-equal", np.full((3, 8), 0.125, np.float32), 0.5),
        SelectionCase("pairwise-ties", f32([[0.3, 0.3, 0.2, 0.2], [0.1, 0.4, 0.1, 0.4],
                                            [0.25, 0.25, 0.25, 0.25]]), 0.7),
        SelectionCase("all-zero", np.zeros((2, 5), np.float32), 0.95),
        SelectionCase("zero-tail", f32([[0.6, 0.4, 0, 0, 0], [0, 0, 1.0, 0, 0]]), 1.0),
        SelectionCase("eta-one", f32(rng.dirichlet(np.full(16, 0.5), 8)), 1.0),
        SelectionCase("single-block", f32([[0.0], [0.7], [1.0]]), 0.95),
        SelectionCase("on-threshold", f32([[0.5, 0.45, 0.05], [0.95, 0.05, 0.0], [0.25, 0.25, 0.5]]), 0.95),
        SelectionCase("tiny-and-huge", f32([[1e-30, 1.0, 2e-38, 3e-38], [1e30, 1e-30, 1e30, 0.0]]), 0.95),
        SelectionCase("subnormal", f32([[0.0, 1e-40, 0.0], [1e-40, 2e-40, 0.0], [1e-39, 0.5, 1e-45]]), 0.95),
    ]
    return cases


SELECTION_RULES = (rules.TopK(1), rules.TopK(4), rules.Threshold(0.01), rules.Threshold(0.25))
"""The rules other than eta that `selection-rules` checks on the `selection_cases` masses."""


def top2_and_newest(mass, ctx):
    """A context rule, one source for every framework: the two blocks of highest mass and each
    row's newest block (the one holding its last key)."""
    newest = (ctx.seq_lens - 1) // ctx.block_size
    return (ctx.rank < 2) | (ctx.block[None, None, :] == newest[:, None, None])


def by_loop_layer_head(mass, ctx):
    """A context rule reading the loop, layer and head: the 1 + (loop + layer + head) % 3 blocks
    of highest mass."""
    return ctx.rank < 1 + (ctx.loop + ctx.layer + ctx.head[None, :, None]) % 3


CONTEXT_RULES = (rules.Custom(top2_and_newest, "top2+newest", context=True),
                 rules.Custom(by_loop_layer_head, "by-loop-layer-head", context=True))
"""The `Custom(..., context=True)` rules that `selection-context` checks on `selection_context_cases`."""


@dataclasses.dataclass(frozen=True)
class SelectionContextCase:
    """mass float32[batch, heads, n_blocks] of a decode call and its numpy SelectionContext."""

    name: str
    mass: np.ndarray
    context: rules.SelectionContext


def selection_context_cases(seed: int = 0, block_size: int = 32) -> list[SelectionContextCase]:
    """Decode-call masses (zero past each row's keys) at several widths, loops and layers, and
    exact ties."""
    rng = np.random.default_rng(seed)
    out = []
    for n, loop, layer in ((1, 0, 0), (6, 1, 3), (24, 0, 1), (128, 1, 0)):
        seq_lens = rng.integers(1, n * block_size + 1, 3).astype(np.int32)
        causal = np.arange(n)[None, :] * block_size < seq_lens[:, None]
        mass = rng.dirichlet(np.full(n, 0.3), (3, 4)) * causal[:, None, :]
        out.append(SelectionContextCase(f"decode-n{n}-loop{loop}-layer{layer}", mass.astype(np.float32),
                                        _context(seq_lens, loop, layer, 4, n, block_size)))
    ties = np.full((2, 2, 8), 0.125, np.float32)
    out.append(SelectionContextCase("all-equal", ties, _context(np.array([256, 97], np.int32), 1, 2, 2, 8,
                                                                block_size)))
    return out


def _context(seq_lens, loop: int, layer: int, heads: int, n: int, block_size: int) -> rules.SelectionContext:
    return rules.SelectionContext(seq_lens=seq_lens, loop=np.int32(loop), layer=np.int32(layer),
                                  head=np.arange(heads, dtype=np.int32), block=np.arange(n, dtype=np.int32),
                                  block_size=block_size)


# -- models and prompts -----------------------------------------------------------------------------
MEDIUM = dataclasses.replace(
    PRESETS["ouro-1.4b"], vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
    bos_token_id=0, eos_token_id=0)
"""A GPU-sized random model with Ouro's head shape (8 heads of 128 here), 4 layers, 4 loops."""

MODELS: dict[str, tuple[ModelConfig, float]] = {
    "test-tiny": (PRESETS["test-tiny"], 0.08), "test-tiny-gqa": (PRESETS["test-tiny-gqa"], 0.08),
    "medium-random": (MEDIUM, 0.03), "test-tiny-huginn": (PRESETS["test-tiny-huginn"], 0.08),
}
"""Random-weight models (config, weight std), written as HF checkpoints; other names are loaded by
`wise_core`. The std keeps attention peaked but not near-hard: larger weights make a random
model chaotic (float32 rounding grows to O(1) logit differences over a few hundred tokens),
which no framework comparison survives."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """Greedy generation settings: prompt lengths and new tokens. Prompts are seeded random ids."""

    prompt_lens: tuple[int, ...]
    max_new_tokens: int
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = np.random.default_rng(self.seed)
        return [rng.integers(0, vocab_size, n).tolist() for n in self.prompt_lens]
