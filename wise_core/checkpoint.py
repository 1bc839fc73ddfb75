"""Checkpoints in the HF Ouro layout: a directory with config.json, model.safetensors (or a
sharded `model.safetensors.index.json`) and optionally tokenizer.json.

Tensors are numpy arrays named as in the released checkpoints (see `expected_shapes`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from wise_core.config import ModelConfig, PRESETS
from wise_core.safetensors_io import read_safetensors, write_safetensors
from wise_core.tokenizer import byte_tokenizer, load_tokenizer

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A missing, malformed or mismatched checkpoint."""


@dataclasses.dataclass
class Checkpoint:
    """config, tensors (name -> float32/other numpy array) and the tokenizer (or None)."""

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    tokenizer: Tokenizer | None = None
    source: str = ""


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an Ouro checkpoint with its shape ([out, in] for linear weights)."""
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


def _is_floating(dtype) -> bool:
    """A numpy dtype of kind "f", or a framework dtype that says it is floating (torch)."""
    floating = getattr(dtype, "is_floating_point", None)
    return bool(floating) if floating is not None else np.dtype(dtype).kind == "f"


def validate_tensors(config: ModelConfig, tensors: dict[str, np.ndarray], source: str = "") -> None:
    """Raise CheckpointError naming every missing, extra or mis-shaped tensor."""
    expected = expected_shapes(config)
    where = f"{source}: " if source else ""
    missing = sorted(set(expected) - set(tensors))
    # A tied checkpoint may still carry lm_head.weight equal to the embedding; accept it.
    extra = sorted(set(tensors) - set(expected) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    problems = [f"missing tensor {n!r} (expected shape {expected[n]})" for n in missing]
    problems += [f"unexpected tensor {n!r} (shape {tuple(tensors[n].shape)})" for n in extra]
    for name in sorted(set(expected) & set(tensors)):
        if tuple(tensors[name].shape) != expected[name]:
            problems.append(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {expected[name]}")
        elif not _is_floating(tensors[name].dtype):
            problems.append(f"tensor {name!r} has non-floating dtype {tensors[name].dtype}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{where}checkpoint does not match its config: {shown}")


def read_weights(directory: Path) -> dict[str, np.ndarray]:
    """Tensors from model.safetensors or a sharded index."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e!r})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: malformed index (weight_map must map tensor names to files)")
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if not (directory / shard).exists():
                raise CheckpointError(f"{index}: shard {shard!r} is missing")
            for name, array in _read_file(directory / shard).items():
                if weight_map.get(name) != shard:
                    raise CheckpointError(f"{directory / shard}: tensor {name!r} is not listed for this shard in the index")
                tensors[name] = array
        return tensors
    single = directory / WEIGHTS_FILE
    if not single.exists():
        raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE}")
    return _read_file(single)


def _read_file(path: Path) -> dict[str, np.ndarray]:
    try:
        return read_safetensors(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def load_checkpoint(path_or_name: str | Path) -> Checkpoint:
    """Read a checkpoint directory, or build a built-in model by name (see `BUILTIN_MODELS`)."""
    name = str(path_or_name)
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]()
    directory = Path(path_or_name)
    if not directory.is_dir():
        raise CheckpointError(
            f"unknown model {name!r}: not a checkpoint directory and not a built-in model "
            f"(built-in: {', '.join(sorted(BUILTIN_MODELS))})")
    try:
        config = ModelConfig.from_json(directory / "config.json")
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    tensors = read_weights(directory)
    validate_tensors(config, tensors, str(directory))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return Checkpoint(config, tensors, load_tokenizer(directory), str(directory))


def save_checkpoint(path: str | Path, checkpoint: Checkpoint, *, bf16: bool = False,
                    max_shard_bytes: int | None = None) -> Path:
    """Write config.json, weights (sharded when `max_shard_bytes` is set) and tokenizer.json."""
    directory = Path(path)
    validate_tensors(checkpoint.config, checkpoint.tensors)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(checkpoint.config.to_dict(), indent=2) + "\n")
    tensors = {k: np.asarray(v, np.float32) for k, v in checkpoint.tensors.items()}
    if max_shard_bytes is None:
        write_safetensors(directory / WEIGHTS_FILE, tensors, bf16=bf16)
    else:
        shards: list[dict[str, np.ndarray]] = [{}]
        size = 0
        for name in sorted(tensors):
            nbytes = tensors[name].size * (2 if bf16 else 4)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensors[name]
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(directory / fname, shard, bf16=bf16)
            weight_map.update({name: fname for name in shard})
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    if checkpoint.tokenizer is not None:
        checkpoint.tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def random_tensors(config: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random Ouro weights: normal(0, std) matrices, unit norms, a zero-bias gate. float32."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            tensors[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            tensors[name] = np.zeros(shape, np.float32)
        else:
            tensors[name] = rng.normal(0.0, std, shape).astype(np.float32)
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
TRAINED_MODEL = "ouro-py-3m"  # trained on the stdlib's source by benchmarks/train_builtin.py


def _packaged(directory: Path):
    return lambda: load_checkpoint(directory)


BUILTIN_MODELS = {"random-tiny": _random_tiny}
BUILTIN_MODELS.update({config.parent.name: _packaged(config.parent)
                       for config in sorted(PACKAGED_MODELS_DIR.glob("*/config.json"))})
DEFAULT_MODEL = TRAINED_MODEL if TRAINED_MODEL in BUILTIN_MODELS else "random-tiny"
