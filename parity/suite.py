"""The shared state of a parity run: settings for this machine, the implementations, the models
both frameworks load, and memoised results (each call or generation runs once per run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path

import jax
import numpy as np
import torch

import wise_jax
import wise_torch
from parity import cases, fp8, huginn
from parity import kv_quant
from parity.convert import DTYPES
from parity.impls import Decoded, Impl, discover_impls, jax_backend
from parity.impls import selectors as default_selectors
from wise_core import modes as M
from wise_core.checkpoint import DEFAULT_MODEL, Checkpoint, load_checkpoint, random_tensors, save_checkpoint
from wise_core.wise_config import WiseConfig, huginn_wise_config
from wise_jax import huginn as jax_huginn
from wise_jax import kv_cache as jax_kv_cache
from wise_torch import huginn as torch_huginn

HUGINN_MODEL = "test-tiny-huginn"   # the Huginn rows' model (random weights, `cases.MODELS`)

# decode_attention calls of the checks: name -> (row modes cycled over the batch, support input).
CALLS = {
    "dense": ((M.DENSE,), "garbage"),            # support ignored
    "sparse-all": ((M.SPARSE,), "all_blocks"),   # every causal block: bitwise dense
    "discover": ((M.DISCOVER,), "garbage"),      # support ignored and replaced
    "union": ((M.DISCOVER_UNION,), "random"),    # support | selection
    "mixed": ((M.SPARSE, M.DENSE), "random"),    # sparse rows attend a random support
}


def jax_precision(dtype: str):
    """float32 models: JAX matmuls in full float32, as torch's (JAX's default on a GPU is TF32)."""
    return jax.default_matmul_precision("float32") if dtype == "float32" else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class EndToEnd:
    """One torch-vs-JAX comparison: float32 runs greedy generation, lower precision teacher-forced
    scoring (the frameworks' roundings differ, so greedy runs could part ways legitimately)."""

    model: str
    torch_kernel: str
    jax_kernel: str
    mode: str  # 'dense' or 'wise'
    dtype: str
    workload: cases.Workload

    @property
    def kernels(self) -> str:
        return f"torch-{self.torch_kernel}|jax-{self.jax_kernel}"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a run covers. `quick`: tiny shapes (CPU CI, interpreted kernels)."""

    quick: bool
    device: str                                   # torch's device; JAX uses its default backend
    attention_cases: tuple[cases.AttentionCase, ...]
    attention_dtypes: tuple[str, ...]
    equivalence_model: str                        # model of the all-blocks generation check
    equivalence_workload: cases.Workload
    e2e: tuple[EndToEnd, ...]
    wise_eta: float = 0.8                         # below the 0.95 default: random models' supports get sparse
    huginn_workload: cases.Workload = cases.Workload((70,), 4)          # the Huginn rows (`HUGINN_MODEL`)
    huginn_kernels: tuple[tuple[str, str], ...] = (("reference", "reference"),)   # torch|jax end to end
    huginn_every_impl: bool = False   # Huginn all-blocks rows for every kernel (GPU), else the references
    # (interpreted kernels on CPU: the same calls as Ouro's all-blocks rows, at many times their cost)
    fp8_model: str = "test-tiny-gqa"                                  # the fp8 engine rows (`parity.fp8`)
    fp8_workload: cases.Workload = cases.Workload((70, 133), 4)       # prefill, 3 decode steps forced
    fp8_modes: tuple[str, ...] = ("wise",)   # CPU: WISE's first loop discovers densely, its others reuse

    @property
    def models(self) -> tuple[str, ...]:
        """Every model the end-to-end comparisons load, in order."""
        return tuple(dict.fromkeys(run.model for run in self.e2e))

    @classmethod
    def for_machine(cls, quick: bool, device: str | None = None) -> "Settings":
        """CUDA when torch sees it (JAX then runs on its GPU backend too), else CPU.

        WISE runs stay short: a support bit that one framework's rounding puts on the other side
        of the threshold changes that head's attention by a whole block, and the chance of one
        grows with the number of selections (tokens x layers x heads)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        gpu = device == "cuda"
        if gpu and jax_backend() not in ("gpu", "cuda", "rocm"):
            raise RuntimeError(f"torch runs on CUDA but JAX on {jax_backend()!r}: install jax with CUDA, "
                               f"or run on CPU with CUDA_VISIBLE_DEVICES=")
        kernels = ("triton", "pallas")  # interpreted without a GPU
        if quick:  # GQA and the default model (MHA); on CPU the interpreted kernels run GQA, 3 tokens
            work, models = cases.Workload((70, 133), 8), ("test-tiny-gqa", DEFAULT_MODEL)
            runs = [(m, ("reference", "reference"), work) for m in models]
            runs += [(m, kernels, work) for m in models] if gpu else [
                ("test-tiny-gqa", kernels, cases.Workload((70,), 3))]
            e2e = tuple(EndToEnd(m, *k, mode, "float32", w) for m, k, w in runs for mode in ("dense", "wise"))
            return cls(quick, device, cases.attention_cases(True), cases.DTYPES, "test-tiny-gqa",
                       cases.Workload((40,), 3), e2e,
                       huginn_kernels=(("reference", "reference"),) + ((kernels,) if gpu else ()),
                       huginn_every_impl=gpu)
        # Full shapes: one workload for the medium model, so the all-blocks check and the dense
        # end-to-end runs share their generations and compilations (the run must stay short on a GPU).
        work = cases.Workload((200, 700), 16)
        runs = [("medium-random", kernels, "dense", "float32"), ("medium-random", kernels, "wise", "float32"),
                (DEFAULT_MODEL, kernels, "dense", "float32"), (DEFAULT_MODEL, kernels, "wise", "float32")]
        if gpu:
            runs += [("medium-random", ("reference", "reference"), "dense", "float32"),
                     ("medium-random", kernels, "dense", "bfloat16"), ("medium-random", kernels, "wise", "bfloat16")]
        e2e = tuple(EndToEnd(model, *k, mode, dtype, work) for model, k, mode, dtype in runs)
        return cls(quick, device, cases.attention_cases(False), cases.DTYPES, "medium-random", work, e2e,
                   fp8_model="medium-random", fp8_workload=work, fp8_modes=("dense", "wise"),
                   huginn_workload=cases.Workload((200, 700), 16),
                   huginn_kernels=(("reference", "reference"),) + ((kernels,) if gpu else ()),
                   huginn_every_impl=gpu)


@dataclasses.dataclass(frozen=True)
class Generated:
    """Greedy tokens per prompt and logits float32[n_tokens, vocab] per prompt (generate), or the
    forced tokens and their log-probs float32[n] (teacher_force); WISE density per reuse loop."""

    tokens: list[list[int]]
    logits: list[np.ndarray]
    density: dict | None = None


class Suite:
    """Settings, implementations and memoised results of one run.

    impls: the attention implementations (default: every kernel importable here);
    selectors: name -> selection function (default: `impls.selectors`); quantizers: name ->
    `parity.kv_quant.Quantizer` (default: `parity.kv_quant.quantizers`). Tests replace any of them to
    plant a difference; models are cached, so perturbing `torch_model(...)` in place is seen by
    every later check.
    """

    def __init__(self, settings: Settings | None = None, *, quick: bool = True,
                 impls: list[Impl] | None = None, selectors: dict | None = None, quantizers: dict | None = None):
        self.settings = settings or Settings.for_machine(quick)
        found, self.unavailable = discover_impls(self.settings.device)
        self.impls = found if impls is None else list(impls)
        self.selectors = default_selectors(self.settings.device) if selectors is None else selectors
        self.quantizers = kv_quant.quantizers(self.settings.device) if quantizers is None else quantizers
        self._dir = tempfile.TemporaryDirectory(prefix="wise-parity-")
        self._memo: dict = {}

    def _once(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    # -- models -------------------------------------------------------------------------------
    def checkpoint_path(self, model: str) -> str:
        """A name both frameworks' `load_model` accept: a random model of `cases.MODELS` written
        as an HF checkpoint directory, or a built-in model's name."""
        if model not in cases.MODELS:
            return model

        def write() -> str:
            config, std = cases.MODELS[model]
            tensors = random_tensors(config, seed=0, std=std)
            path = Path(self._dir.name) / model
            save_checkpoint(path, Checkpoint(config, tensors, None, model))
            return str(path)
        return self._once(("checkpoint", model), write)

    def checkpoint(self, model: str) -> Checkpoint:
        return self._once(("tensors", model), lambda: load_checkpoint(self.checkpoint_path(model)))

    def torch_model(self, model: str, dtype: str = "float32") -> wise_torch.OuroForCausalLM:
        return self._once(("torch", model, dtype), lambda: wise_torch.load_model(
            self.checkpoint_path(model), dtype=DTYPES[dtype][0], device=self.settings.device))

    def jax_model(self, model: str, dtype: str = "float32"):
        """(config, params)."""
        return self._once(("jax", model, dtype), lambda: wise_jax.load_model(
            self.checkpoint_path(model), dtype=DTYPES[dtype][1]))

    # -- attention calls ----------------------------------------------------------------------
    def call_inputs(self, case: cases.AttentionCase, dtype: str, call: str) -> tuple[np.ndarray, np.ndarray]:
        """(modes int32[batch], support bool[batch, heads, max_blocks]) of a call in `CALLS`."""
        cycle, support = CALLS[call]
        modes = np.array([cycle[b % len(cycle)] for b in range(case.batch)], np.int32)
        return modes, np.array(case.inputs(dtype)[support])

    def decode(self, impl: Impl, case: cases.AttentionCase, dtype: str, call: str) -> Decoded:
        """One call of `CALLS` by `impl` (the case's arrays are moved to the device once)."""
        def run() -> Decoded:
            inputs = case.fp8_inputs if isinstance(case, fp8.Fp8AttentionCase) else case.inputs
            arrays = self._once(("arrays", impl.framework, impl.device, case, dtype),
                                lambda: impl.to_device(inputs(dtype), dtype))
            modes, support = self.call_inputs(case, dtype, call)
            return impl.decode(arrays, modes, support, block_size=case.block_size, eta=case.eta)
        return self._once(("decode", impl, case, dtype, call), run)

    def spec(self, case: cases.AttentionCase, dtype: str, call: str) -> tuple[np.ndarray, np.ndarray]:
        """The float64 specification of a call: (out [batch, heads, head_dim], mass [batch, heads, max_blocks])."""
        def run():
            modes, support = self.call_inputs(case, dtype, call)
            return case.spec(dtype, support, modes)
        return self._once(("spec", case, dtype, call), run)

    # -- the fp8 K/V quantization rule ---------------------------------------------------------
    def quantized(self, name: str, case: kv_quant.KVQuantCase, dtype: str) -> tuple[np.ndarray, np.ndarray, dict]:
        """quantizers[name] on the case's pages in `dtype`: (codes, scales, {output dtype:
        dequantized values as float32}), each dequantized from that quantizer's own codes."""
        def run():
            quantizer = self.quantizers[name]
            codes, scales = quantizer.quantize(case.inputs(dtype))
            return codes, scales, {out: quantizer.dequantize(codes, scales, out) for out in kv_quant.DTYPES}
        return self._once(("kv-quant", name, case, dtype), run)

    # -- the fp8 K/V cache in the engines -------------------------------------------------------
    def forced_tokens(self, model: str, workload: cases.Workload) -> tuple[list[list[int]], list[list[int]]]:
        """(contexts, continuations) of the teacher-forced runs: the workload's prompts and a
        seeded random continuation of workload.max_new_tokens tokens after each."""
        vocab = self.checkpoint(model).config.vocab_size
        contexts = workload.prompts(vocab)
        rng = np.random.default_rng(workload.seed + 1)
        return contexts, [rng.integers(0, vocab, workload.max_new_tokens).tolist() for _ in contexts]

    def fp8_forced(self, framework: str, mode: str, kv_cache_dtype: str) -> fp8.ForcedRun:
        """The settings' fp8 model and workload teacher-forced through `framework`'s engine
        (`LLM(..., kv_cache_dtype=...)`, the reference kernel, every request admitted at once, no
        prefix caching), mode 'dense' or 'wise' (`_wise_config`), float32; its pages read as it
        runs (`parity.fp8.forced_run`)."""
        def run() -> fp8.ForcedRun:
            model, work = self.settings.fp8_model, self.settings.fp8_workload
            contexts, continuations = self.forced_tokens(model, work)
            lengths = [len(c) + len(f) for c, f in zip(contexts, continuations)]
            page_size = 32
            args = dict(wise_config=self._wise_config(mode), attention_backend="reference",
                        num_pages=sum(-(-n // page_size) for n in lengths), page_size=page_size,
                        max_num_seqs=len(lengths), max_model_len=max(lengths), enable_prefix_caching=False,
                        kv_cache_dtype=kv_cache_dtype, seed=0)
            if framework == "torch":
                llm = wise_torch.LLM(self.torch_model(model), **args)
                cache = llm.runner.cache
                return fp8.forced_run(llm, lambda: {name: getattr(cache, name).cpu().numpy()
                                                    for name in cache.storage_names()}, contexts, continuations)
            config, params = self.jax_model(model)
            with jax_precision("float32"):
                llm = wise_jax.LLM(params, config, **args)
                return fp8.forced_run(llm, lambda: {name: np.asarray(getattr(llm.cache, name))
                                                    for name in jax_kv_cache.storage_names(llm.cache)},
                                      contexts, continuations)
        return self._once(("fp8-forced", framework, mode, kv_cache_dtype), run)

    # -- generation ---------------------------------------------------------------------------
    def generate(self, framework: str, model: str, kernel: str, mode: str, workload: cases.Workload,
                 dtype: str = "float32") -> Generated:
        """Greedy generation (no early stop), the engine's attention_backend `kernel` (the parity
        impls' names are backends too). mode: 'dense', 'wise' (WiseConfig with the settings' eta)
        or 'all-blocks' (WiseConfig(all_blocks=True))."""
        def run() -> Generated:
            wise_config = self._wise_config(mode)
            if framework == "torch":
                torch_model = self.torch_model(model, dtype)
                out = wise_torch.generate(torch_model, workload.prompts(torch_model.config.vocab_size),
                                          max_new_tokens=workload.max_new_tokens, eos_token_id=None,
                                          wise_config=wise_config, return_logits=True, attention_backend=kernel)
                logits, density = [x.float().numpy() for x in out.logits], out.stats.density
            else:
                config, params = self.jax_model(model, dtype)
                with jax_precision(dtype):
                    out = wise_jax.generate(params, config, workload.prompts(config.vocab_size),
                                            max_new_tokens=workload.max_new_tokens, eos_token_id=None,
                                            wise_config=wise_config, return_logits=True, attention_backend=kernel)
                logits, density = [np.asarray(x, np.float32) for x in out.logits], out.stats.density
            return Generated(out.tokens, logits, density if mode == "wise" else None)
        return self._once(("generate", framework, model, kernel, mode, workload, dtype), run)

    def _wise_config(self, mode: str) -> WiseConfig | None:
        if mode == "dense":
            return None
        if mode == "wise":
            return WiseConfig(eta=self.settings.wise_eta)
        if mode == "all-blocks":
            return WiseConfig(all_blocks=True)
        raise ValueError(f"unknown generation mode {mode!r} (dense, wise, all-blocks)")

    def huginn_models(self):
        """(torch model, JAX params) of `HUGINN_MODEL` in float32 on the settings' device."""
        def load():
            ckpt = self.checkpoint(HUGINN_MODEL)
            return (torch_huginn.huginn_from_tensors(ckpt.config, ckpt.tensors, device=self.settings.device),
                    jax_huginn.huginn_from_tensors(ckpt.config, ckpt.tensors))
        return self._once(("huginn",), load)

    def huginn_generate(self, framework: str, kernel: str, mode: str) -> Generated:
        """Greedy generation of `HUGINN_MODEL` (`parity.huginn`) over the settings' Huginn
        workload, total_ut_steps core iterations, decode attention `kernel`: mode 'dense', 'wise'
        (`huginn_wise_config` with the settings' eta) or 'all-blocks' (the same, every block
        selected)."""
        def run() -> Generated:
            config = self.checkpoint(HUGINN_MODEL).config
            steps, work = config.total_ut_steps, self.settings.huginn_workload
            wise_config = None if mode == "dense" else huginn_wise_config(
                steps, eta=self.settings.wise_eta, all_blocks=mode == "all-blocks")
            torch_model, params = self.huginn_models()
            args = dict(max_new_tokens=work.max_new_tokens, num_steps=steps, wise_config=wise_config, kernel=kernel)
            if framework == "torch":
                tokens, logits, wise = huginn.torch_generate(torch_model, work.prompts(config.vocab_size), **args)
                density = None if wise is None else wise.density()
            else:
                with jax_precision("float32"):
                    tokens, logits, wise = huginn.jax_generate(params, config, work.prompts(config.vocab_size), **args)
                density = None if wise is None else wise.density(wise_config)
            return Generated(tokens, logits, density if mode == "wise" else None)
        return self._once(("huginn-generate", framework, kernel, mode), run)

    def teacher_force(self, framework: str, model: str, kernel: str, mode: str, workload: cases.Workload,
                      dtype: str) -> Generated:
        """Log-probs of a seeded random continuation (`workload.max_new_tokens` tokens) after each
        prompt: both frameworks score the same tokens, so low-precision runs cannot diverge."""
        def run() -> Generated:
            wise_config = self._wise_config(mode)
            contexts, continuations = self.forced_tokens(model, workload)
            if framework == "torch":
                out = wise_torch.teacher_force(self.torch_model(model, dtype), contexts, continuations,
                                               wise_config=wise_config, attention_backend=kernel)
                logprobs = [x.float().numpy() for x in out.logprobs]
            else:
                config, params = self.jax_model(model, dtype)
                with jax_precision(dtype):
                    out = wise_jax.teacher_force(params, config, contexts, continuations, wise_config=wise_config,
                                                 attention_backend=kernel)
                logprobs = [np.asarray(x, np.float32) for x in out.logprobs]
            return Generated(continuations, logprobs)
        return self._once(("forced", framework, model, kernel, mode, workload, dtype), run)
