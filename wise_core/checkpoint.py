"""Checkpoints in the HF Ouro or Huginn layout: a directory with config.json, model.safetensors
(or a sharded `model.safetensors.index.json`) and optionally tokenizer.json.

Tensors are named as in the released checkpoints (see `expected_shapes`, `huginn_shapes`). `open_checkpoint`
reads a directory as far as its headers and checks every tensor's name, shape and dtype against
the config, reading no data (the frameworks' loaders then read the data straight into their
dtype and device); `load_checkpoint` reads the tensors into numpy arrays as stored.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from wise_core.model_config import ModelConfig
from wise_core.presets import PRESETS
from wise_core.safetensors_io import FLOAT_DTYPES, TensorInfo, read_header, read_tensors, write_tensors
from wise_core.tokenizer import byte_tokenizer, load_tokenizer

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A missing, malformed or mismatched checkpoint."""


@dataclasses.dataclass
class Checkpoint:
    """config, tensors (name -> numpy array, in memory) and the tokenizer (or None)."""

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    tokenizer: Tokenizer | None = None
    source: str = ""


@dataclasses.dataclass
class CheckpointFiles:
    """A checkpoint directory read as far as its headers, checked against its config: tensors
    maps each name to its TensorInfo (file, dtype, shape); no tensor data is read. The
    frameworks' loaders read the data straight into their dtype and device."""

    config: ModelConfig
    tensors: dict[str, TensorInfo]
    tokenizer: Tokenizer | None = None
    source: str = ""

    def by_file(self) -> dict[Path, list[str]]:
        """file -> the names of the tensors it holds."""
        out: dict[Path, list[str]] = {}
        for name, info in self.tensors.items():
            out.setdefault(info.path, []).append(name)
        return out


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of `config`'s architecture with its shape ([out, in] for
    linear weights)."""
    if config.architecture == "huginn":
        return huginn_shapes(config)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,), "input_layernorm_2.weight": (h,),
        "post_attention_layernorm.weight": (h,), "post_attention_layernorm_2.weight": (h,),
    }
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,),
              "model.early_exit_gate.weight": (1, h), "model.early_exit_gate.bias": (1,)}
    for n in range(config.num_hidden_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{n}.{name}"] = shape
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


HUGINN_STACKS = ("prelude", "core_block", "coda")
"""Huginn's layer stacks in order: transformer.{stack}.{i}.* (see `huginn_layers`)."""


def huginn_layers(config: ModelConfig) -> list[tuple[str, int]]:
    """(stack, index) of every Huginn layer in forward order, once (the core block's layers once,
    though they run total_ut_steps times)."""
    counts = (config.n_layers_in_prelude, config.n_layers_in_recurrent_block, config.n_layers_in_coda)
    return [(stack, n) for stack, count in zip(HUGINN_STACKS, counts) for n in range(count)]


def huginn_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a huginn-0125 checkpoint (the released RavenForCausalLM's names) with its
    shape. Per layer: attn.Wqkv.weight stacks q, k, v rows; attn.qk_bias [2, 1, heads, head_dim]
    holds q's then k's bias (when config.qk_bias); mlp.fc.weight stacks the gate's rows, then the
    up projection's. transformer.adapter.weight [hidden, 2 hidden] maps [state, embedded input]
    into the core block. The head is tied to transformer.wte when tie_word_embeddings."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    per_layer = {"norm_1.weight": (h,), "attn.Wqkv.weight": ((heads + 2 * kv) * d, h),
                 "attn.proj.weight": (h, heads * d), "norm_2.weight": (h,), "mlp.fc.weight": (2 * i, h),
                 "mlp.proj.weight": (h, i), "norm_3.weight": (h,), "norm_4.weight": (h,)}
    if config.qk_bias:
        per_layer["attn.qk_bias"] = (2, 1, heads, d)
    shapes = {"transformer.wte.weight": (config.vocab_size, h), "transformer.adapter.weight": (h, 2 * h),
              "transformer.ln_f.weight": (h,)}
    for stack, n in huginn_layers(config):
        for name, shape in per_layer.items():
            shapes[f"transformer.{stack}.{n}.{name}"] = shape
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def optional_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensors a checkpoint may carry beyond `expected_shapes`, which loading drops: a tied head's
    lm_head.weight, and Huginn's persistent RoPE table freqs_cis [1, positions, 1, head_dim / 2,
    2] (wise computes it)."""
    out = {"lm_head.weight": (config.vocab_size, config.hidden_size)} if config.tie_word_embeddings else {}
    if config.architecture == "huginn":
        out["freqs_cis"] = (1, config.max_position_embeddings, 1, config.head_dim // 2, 2)
    return out


def _is_floating(dtype) -> bool:
    """A floating numpy dtype (ml_dtypes bfloat16 included), or a framework dtype that says it is
    floating (torch)."""
    floating = getattr(dtype, "is_floating_point", None)
    return bool(floating) if floating is not None else np.dtype(dtype) in FLOAT_DTYPES


def validate_tensors(config: ModelConfig, tensors, source: str = "") -> None:
    """Raise CheckpointError naming every missing, extra, mis-shaped or non-floating tensor.
    tensors: name -> anything with .shape and .dtype (numpy arrays, TensorInfo, torch tensors)."""
    expected, optional = expected_shapes(config), optional_shapes(config)
    where = f"{source}: " if source else ""
    missing = sorted(set(expected) - set(tensors))
    # A tied checkpoint may still carry lm_head.weight equal to the embedding; accept it.
    extra = sorted(set(tensors) - set(expected) - set(optional))
    problems = [f"missing tensor {n!r} (expected shape {expected[n]})" for n in missing]
    problems += [f"unexpected tensor {n!r} (shape {tuple(tensors[n].shape)})" for n in extra]
    expected = {**optional, **expected}
    for name in sorted(set(expected) & set(tensors)):
        if tuple(tensors[name].shape) != expected[name]:
            problems.append(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {expected[name]}")
        elif not _is_floating(tensors[name].dtype):
            problems.append(f"tensor {name!r} has non-floating dtype {tensors[name].dtype}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{where}checkpoint does not match its config: {shown}")


def index_weights(directory: Path) -> dict[str, TensorInfo]:
    """Where each tensor of model.safetensors or a sharded index lies, from the headers alone."""
    index = directory / INDEX_FILE
    if index.exists():
        _check_file(index)
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: malformed index (weight_map must map tensor names to files)")
        outside = sorted(f for f in set(weight_map.values()) if f != Path(f).name or f in ("", ".", ".."))
        if outside:   # a shard is a file of this directory, never a path elsewhere
            raise CheckpointError(f"{index}: shard {outside[0]!r} is not a file name in the checkpoint directory")
        tensors: dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            if not (directory / shard).is_file():
                raise CheckpointError(f"{index}: shard {shard!r} is missing")
            held = _read_header(directory / shard)
            for name in held:
                if weight_map.get(name) != shard:
                    raise CheckpointError(f"{directory / shard}: tensor {name!r} is not listed for this shard in the index")
            absent = sorted(n for n, f in weight_map.items() if f == shard and n not in held)
            if absent:
                raise CheckpointError(f"{index}: lists tensors {absent[:4]} in shard {shard!r}, which lacks them")
            tensors.update(held)
        return tensors
    single = directory / WEIGHTS_FILE
    if not single.exists():
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE}")
    _check_file(single)
    return _read_header(single)


def _check_file(path: Path) -> None:
    """A checkpoint's file that is something else (a directory) is a CheckpointError naming it."""
    if not path.is_file():
        raise CheckpointError(f"{path} is {'a directory' if path.is_dir() else 'not a regular file'}, not a file")


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        return read_header(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _directory(path_or_name) -> Path:
    if not isinstance(path_or_name, (str, Path)):
        raise CheckpointError(f"a model is a checkpoint directory or a built-in model name, got "
                              f"{type(path_or_name).__name__} {path_or_name!r:.80}")
    name = str(path_or_name)
    directory = Path(path_or_name)
    if not name or not directory.is_dir():
        raise CheckpointError(
            f"unknown model {name!r}: not a checkpoint directory and not a built-in model "
            f"(built-in: {', '.join(sorted(BUILTIN_MODELS))})")
    return directory


def open_checkpoint(path_or_name: str | Path) -> Checkpoint | CheckpointFiles:
    """A built-in model in memory (see `BUILTIN_MODELS`: random ones are built, packaged ones are
    directories), or a checkpoint directory read as far as its headers and checked against its
    config (CheckpointFiles)."""
    if isinstance(path_or_name, str) and path_or_name in BUILTIN_MODELS:
        return BUILTIN_MODELS[path_or_name]()
    directory = _directory(path_or_name)
    try:
        config = ModelConfig.from_json(directory / "config.json")
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    tensors = index_weights(directory)
    validate_tensors(config, tensors, str(directory))
    for name in optional_shapes(config):
        tensors.pop(name, None)
    tokenizer = load_tokenizer(directory)
    if tokenizer is not None:
        check_tokenizer(tokenizer, config, str(directory))
    return CheckpointFiles(config, tensors, tokenizer, str(directory))


def check_tokenizer(tokenizer: Tokenizer, config: ModelConfig, source: str = "") -> None:
    """A tokenizer that cannot be this model's is a CheckpointError: one whose ids reach past the
    model's vocabulary, or that has no token for the model's eos id (its text would decode to
    nothing the model means). A smaller vocabulary is fine (models pad theirs)."""
    where = f"{source}: " if source else ""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > config.vocab_size:
        raise CheckpointError(f"{where}tokenizer.json has {size} tokens, more than the model's vocab_size "
                              f"{config.vocab_size}: it is not this model's tokenizer")
    eos = config.eos_token_id
    if eos is not None and tokenizer.id_to_token(eos) is None:
        raise CheckpointError(f"{where}tokenizer.json has no token for the model's eos_token_id {eos} "
                              f"(its {size} tokens): it is not this model's tokenizer")


def load_checkpoint(path_or_name: str | Path) -> Checkpoint:
    """A checkpoint with its tensors read into numpy arrays, in their stored dtypes (BF16 as
    ml_dtypes.bfloat16). The frameworks' load_model read the files directly instead."""
    found = open_checkpoint(path_or_name)
    if isinstance(found, Checkpoint):
        return found
    tensors: dict[str, np.ndarray] = {}
    for path, names in found.by_file().items():
        try:
            tensors.update(read_tensors(path, names))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return Checkpoint(found.config, tensors, found.tokenizer, found.source)


def save_checkpoint(path: str | Path, checkpoint: Checkpoint, *, bf16: bool = False,
                    max_shard_bytes: int | None = None) -> Path:
    """Write config.json, weights (sharded when `max_shard_bytes` is set) and tokenizer.json."""
    directory = Path(path)
    validate_tensors(checkpoint.config, checkpoint.tensors)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(checkpoint.config.to_dict(), indent=2) + "\n")
    tensors = {k: np.asarray(v) for k, v in checkpoint.tensors.items()}
    if max_shard_bytes is None:
        write_tensors(directory / WEIGHTS_FILE, tensors, bf16=bf16)
    else:
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name in sorted(tensors):
            nbytes = tensors[name].size * (2 if bf16 else tensors[name].itemsize)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensors[name]
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_tensors(directory / fname, shard, bf16=bf16)
            weight_map.update({name: fname for name in shard})
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    if checkpoint.tokenizer is not None:
        checkpoint.tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def random_init(name: str) -> str:
    """How random weights fill the tensor `name` (`random_tensors`, the benchmarks' random
    models): "ones" (every norm), "zeros" (Ouro's exit-gate bias), else "normal" (matrices, and
    Huginn's q / k biases, attn.qk_bias)."""
    if name.endswith("norm.weight") or "layernorm" in name or name == "transformer.ln_f.weight" \
            or name.rpartition(".")[0].rpartition(".")[2].startswith("norm_"):
        return "ones"
    return "zeros" if name.endswith(".bias") else "normal"


def random_tensors(config: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random weights as `random_init` says, normal(0, std) from one generator in name order.
    float32."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        kind = random_init(name)
        if kind == "normal":
            tensors[name] = rng.normal(0.0, std, shape).astype(np.float32)
        else:
            tensors[name] = (np.ones if kind == "ones" else np.zeros)(shape, np.float32)
    return tensors


RANDOM_TINY = dataclasses.replace(
    PRESETS["test-tiny"], vocab_size=258, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    bos_token_id=256, eos_token_id=256, pad_token_id=257)


def _random_tiny() -> Checkpoint:
    # Larger std than usual so that a random model's attention is not flat.
    return Checkpoint(RANDOM_TINY, random_tensors(RANDOM_TINY, seed=0, std=0.08), byte_tokenizer(),
                      "random-tiny")


# Trained models shipped in wise_core/models/<name>/ (checkpoint directories).
PACKAGED_MODELS_DIR = Path(__file__).resolve().parent / "models"
TRAINED_MODEL = "ouro-py-3m"  # trained on the stdlib's source by benchmarks/train/train_builtin.py
TRAINED_HUGINN_MODEL = "huginn-py-3m"  # the same, Huginn architecture (train_builtin --architecture huginn)


BUILTIN_MODELS = {"random-tiny": _random_tiny}
"""name -> () -> Checkpoint (random models, built in memory) or CheckpointFiles (packaged ones)."""
BUILTIN_MODELS.update({config.parent.name: functools.partial(open_checkpoint, config.parent)
                       for config in sorted(PACKAGED_MODELS_DIR.glob("*/config.json"))})
DEFAULT_MODEL = TRAINED_MODEL if TRAINED_MODEL in BUILTIN_MODELS else "random-tiny"
