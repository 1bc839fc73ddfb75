"""The fp8 K/V cache across frameworks (issue 50), past the quantization rule (`parity.kv_quant`):
what the two engines write into their fp8 pools for the same model and prompts, how their decode
on fp8 pages agrees, and the decode-attention cases over fp8 pages.

Why the engines' pages are compared within a bound, not bitwise. torch and JAX quantize equal
K/V to the same bytes (the `kv-quant` rows, bitwise), but an engine quantizes the K/V its own
float32 forward computed, and the two forwards round differently (the `end-to-end` rows: logits
within `rounding.model_bound`). A code then differs where a value lies within that difference of
an e4m3fn rounding decision, and a scale where the vector's largest |value| differs in its last
bits (scale = amax * C); later loops read the differing codes, so their K/V differ by more.
Measured on `test-tiny-gqa` (prompts of 70 and 133 tokens, 3 decode steps, WISE): the first
plane's codes are bitwise equal, the last plane's differ in up to 6 % of entries; 87 % of the
scales differ, by 0.6 % at most.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from parity import cases
from wise_core import kv_quant as spec
from wise_core import rounding
from wise_core.sampling_params import SamplingParams

SCALE_TOLERANCE = 2.0 ** -5
"""How far two engines' K/V may differ before quantization, relative to the vector's largest
|value| (amax = 448 * scale): the scales are held to it, and it enters each value's bound
(`entry_bound`). The frameworks' float rounding, compounded over the loops by the codes that
already differ, moved amax by 0.6 % at most on `test-tiny-gqa` (the last loop's planes); a layout
bug (another token's or head's vector, a missing write) moves it by O(1)."""


def entry_bound(scale_a: np.ndarray, scale_b: np.ndarray) -> np.ndarray:
    """How far two engines' dequantized values of one entry may lie apart, from their vectors'
    scales (float32 [...]): each is within 16 * scale of the K/V it quantized (half the e4m3fn
    spacing of the top binade [256, 448], times the scale: `wise_core.kv_quant`'s round-trip
    bound), and those K/V differ by SCALE_TOLERANCE * 448 * scale at most."""
    larger = np.maximum(scale_a, scale_b).astype(np.float64)
    return 16 * (scale_a.astype(np.float64) + scale_b) + SCALE_TOLERANCE * spec.E4M3_MAX * larger


@dataclasses.dataclass(frozen=True)
class PagesDifference:
    """Two engines' fp8 pages of one request set, compared (`compare_pages`): codes that differ
    (of `entries`), values beyond `entry_bound` (or NaN on one side only), scales that differ (of
    `vectors`), scales beyond SCALE_TOLERANCE, the largest |value difference| / entry_bound."""

    codes: int
    values_far: int
    scales: int
    scales_far: int
    entries: int
    vectors: int
    largest_ratio: float
    lines: tuple[str, ...]

    @property
    def fraction(self) -> float:
        """Share of codes that differ (f of `forced_bound`)."""
        return self.codes / max(self.entries, 1)


def compare_pages(a: list[dict], b: list[dict]) -> PagesDifference:
    """a, b: per request {"k", "v": uint8 [planes, tokens, kv_heads, head_dim], "k_scale",
    "v_scale": float32 [planes, tokens, kv_heads]} (`forced_run`'s pages) of two engines."""
    codes = values_far = scales = scales_far = entries = vectors = 0
    largest, lines = 0.0, []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for name in ("k", "v"):
            ca, cb, sa, sb = x[name], y[name], x[f"{name}_scale"], y[f"{name}_scale"]
            if ca.shape != cb.shape or sa.shape != sb.shape:
                raise ValueError(f"request {i} {name}: pages of shapes {ca.shape} / {sa.shape} vs "
                                 f"{cb.shape} / {sb.shape}")
            va = spec.decode_e4m3fn(ca).astype(np.float64) * sa[..., None]
            vb = spec.decode_e4m3fn(cb).astype(np.float64) * sb[..., None]
            with np.errstate(invalid="ignore"):
                ratio = np.abs(va - vb) / entry_bound(sa, sb)[..., None]
            far = (ratio > 1) | (np.isnan(va) != np.isnan(vb))
            rel = np.abs(sa.astype(np.float64) - sb) / np.maximum(sa, sb)
            differ = ca != cb
            codes, values_far = codes + int(differ.sum()), values_far + int(far.sum())
            scales, scales_far = scales + int((sa != sb).sum()), scales_far + int((rel > SCALE_TOLERANCE).sum())
            entries, vectors = entries + ca.size, vectors + sa.size
            largest = max(largest, float(np.nanmax(ratio, initial=0.0)))
            per_plane = differ.reshape(differ.shape[0], -1).sum(-1)
            lines.append(f"request {i} {name}: {int(differ.sum())} of {differ.size} codes differ "
                         f"(per plane {per_plane.tolist()}), {int(far.sum())} values beyond their bound; "
                         f"{int((sa != sb).sum())} of {sa.size} scales differ, largest by {rel.max(initial=0.0):.2g}")
            if far.any():
                where = tuple(int(j) for j in np.argwhere(far)[0])
                lines.append(f"request {i} {name}: first value beyond its bound at [plane, token, head, dim] "
                             f"{list(where)}: {va[where]:.6g} vs {vb[where]:.6g} (codes 0x{int(ca[where]):02X}, "
                             f"0x{int(cb[where]):02X}; scales {sa[where[:-1]]:.6g}, {sb[where[:-1]]:.6g})")
    return PagesDifference(codes, values_far, scales, scales_far, entries, vectors, largest, tuple(lines))


@dataclasses.dataclass(frozen=True)
class ForcedRun:
    """An engine's teacher-forced run: log-probs per request float32[n]; its fp8 pages per request
    (`compare_pages`' layout, every position whose K/V was written: context + n - 1), None for an
    unquantized pool; WISE density per reuse loop (None when dense)."""

    logprobs: list[np.ndarray]
    pages: list[dict] | None
    density: dict | None


def forced_run(llm, storage, contexts: list[list[int]], continuations: list[list[int]]) -> ForcedRun:
    """Each context prefilled and its continuation decoded forced on `llm` (all admitted at
    once). storage() -> {name: numpy array} of the pool (`PagedKVCache` fields k, v, k_scale,
    v_scale: [planes, pages + 1, page_size, ...]), read after every step so that a request's pages
    are read before they could be handed on."""
    ids = [llm.add_request(c, SamplingParams(max_tokens=len(f)), forced=f) for c, f in zip(contexts, continuations)]
    seqs = {rid: llm.sequences[rid] for rid in ids}
    outputs, pages = {}, {}
    while llm.has_unfinished():
        before = {rid: list(seqs[rid].pages) for rid in ids if rid not in outputs}
        for out in llm.step():
            if out.finished:
                outputs[out.request_id] = out
        pool = storage()
        if "k_scale" not in pool:
            continue
        for rid, held in before.items():
            held = list(seqs[rid].pages) or held       # a request finished in this step: its pages before it
            pages[rid] = {name: x[:, held].reshape(x.shape[0], -1, *x.shape[3:]) for name, x in pool.items()}
    lengths = [len(c) + len(f) - 1 for c, f in zip(contexts, continuations)]
    return ForcedRun([np.asarray(outputs[rid].logprobs, np.float32) for rid in ids],
                     [{name: x[:, :n] for name, x in pages[rid].items()} for rid, n in zip(ids, lengths)]
                     if pages else None,
                     llm.stats().density)


def forced_bound(config, fp8, other, unquantized, fraction: float) -> tuple[float, float, float]:
    """(bound, E, model_bound) on |log-prob(fp8) - log-prob(other)| of two frameworks' fp8 runs.

    model_bound (`rounding.model_bound` at the largest |log-prob|, the end-to-end rows' basis):
    the frameworks' float rounding, as without quantization. Plus the codes that differ
    (`fraction` f of them, each one e4m3fn step, `compare_pages`): quantizing moves each value by a
    fraction of a step, spread evenly over +-step/2 (RMS step / sqrt(12)); a differing code moves
    it by a whole step, so the differing codes perturb the K/V by sqrt(12 f) times the RMS of the
    quantization's own perturbation, and, on the rounding basis's linear model with independent
    signs, the log-probs by sqrt(12 f) times the quantization's own effect E = max |log-prob(fp8)
    - log-prob(unquantized)| (`unquantized`: `fp8`'s framework with kv_cache_dtype 'auto')."""
    effect = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(fp8, unquantized))
    scale = max(float(np.abs(x).max()) for x in fp8 + other)
    base = rounding.model_bound(config, scale=scale)
    return base + math.sqrt(12 * fraction) * effect, effect, base


# -- decode attention over fp8 pages -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fp8AttentionCase(cases.AttentionCase):
    """An `AttentionCase` whose K/V pages are held in fp8: quantized by the numpy spec from the
    case's pages in the call's dtype. `inputs(dtype)` gives the dequantized pages (float32 holding
    dtype's values: what an implementation attends, and what the float64 spec and the bounds
    see); `fp8_inputs(dtype)` the codes and scales the implementations read."""

    @functools.lru_cache(maxsize=None)
    def _quantized(self, dtype: str) -> dict[str, np.ndarray]:
        x = super().inputs(dtype)
        out = {}
        for name in ("k", "v"):
            codes, scales = spec.quantize(x[f"{name}_pages"])      # float32 holding dtype's values: exact
            out[f"{name}_codes"], out[f"{name}_scale"] = codes, scales
            out[f"{name}_values"] = spec.dequantize(codes, scales, dtype).astype(np.float32)
        return out

    @functools.lru_cache(maxsize=None)
    def inputs(self, dtype: str) -> dict[str, np.ndarray]:
        arrays = dict(super().inputs(dtype))
        q = self._quantized(dtype)
        arrays["k_pages"], arrays["v_pages"] = q["k_values"], q["v_values"]
        for array in arrays.values():
            array.flags.writeable = False
        return arrays

    def fp8_inputs(self, dtype: str) -> dict[str, np.ndarray]:
        """q (float32 holding dtype's values), k_pages, v_pages (uint8 codes), k_scale, v_scale
        (float32 [num_pages, page_size, kv_heads]), page_table, seq_lens."""
        q = self._quantized(dtype)
        x = self.inputs(dtype)
        return {"q": x["q"], "k_pages": q["k_codes"], "v_pages": q["v_codes"], "k_scale": q["k_scale"],
                "v_scale": q["v_scale"], "page_table": x["page_table"], "seq_lens": x["seq_lens"]}


def fp8_attention_cases(quick: bool) -> tuple[Fp8AttentionCase, ...]:
    """`cases.attention_cases` with their pages in fp8 (same shapes, seeds and lengths); on CPU
    the MHA case only (its bf16 launch reduces over tiles of two pages; GQA's fp8 reads are
    tests/wise_jax/test_pallas_decode.py's), as each interpreted kernel call costs seconds."""
    chosen = cases.attention_cases(quick)[:1] if quick else cases.attention_cases(quick)
    return tuple(Fp8AttentionCase(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
                                  | {"name": f"fp8-{c.name}"}) for c in chosen)
