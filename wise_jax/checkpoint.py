"""Save and restore converted Params with orbax-checkpoint.

A saved directory holds `wise_params.json` (every tensor's shape and dtype) and `orbax/` (the
arrays). Restoring checks the manifest against the config before reading any array, so a
mismatched checkpoint is reported by tensor name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from wise_core.checkpoint import CheckpointError
from wise_core.model_config import ModelConfig
from wise_jax.params import LayerParams, Params, param_shapes

MANIFEST = "wise_params.json"
ARRAYS = "orbax"
FORMAT = "wise_jax.params/1"


def _as_dict(params: Params) -> dict:
    """Params -> nested dict of its arrays (lm_head left out when tied)."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    out["layers"] = {f.name: getattr(params.layers, f.name) for f in dataclasses.fields(params.layers)}
    if out["lm_head"] is None:
        del out["lm_head"]
    return out


def _from_dict(tree: dict) -> Params:
    return Params(**{**tree, "layers": LayerParams(**tree["layers"]), "lm_head": tree.get("lm_head")})


def _flat(tree: dict, prefix: str = "") -> dict:
    """Nested dict -> {"layers.q_proj": leaf, ...}."""
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{name}."))
        else:
            out[prefix + name] = value
    return out


def save_params(path: str | Path, params: Params, *, overwrite: bool = False) -> Path:
    """Write params to directory `path` (orbax arrays + manifest); refuses an existing path
    unless `overwrite`."""
    directory = Path(path).absolute()
    if directory.exists():
        if not overwrite:
            raise FileExistsError(f"{directory} already exists (pass overwrite=True to replace it)")
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    tree = _as_dict(params)
    manifest = {"format": FORMAT, "tensors": {
        name: {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name} for name, x in _flat(tree).items()}}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / ARRAYS, tree)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return directory


def restore_params(path: str | Path, config: ModelConfig) -> Params:
    """Read params saved by `save_params` for `config`, in the dtypes they were saved in.

    Raises CheckpointError when the directory is not such a checkpoint, when its tensors do not
    match `config`, or when the arrays cannot be read."""
    directory = Path(path).absolute()
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{directory}: not a wise_jax params checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
        saved = {name: (tuple(t["shape"]), jnp.dtype(t["dtype"])) for name, t in manifest["tensors"].items()}
        if manifest["format"] != FORMAT:
            raise ValueError(f"format {manifest['format']!r}, expected {FORMAT!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest_path}: malformed manifest ({e})") from None

    expected = _flat(_as_dict(param_shapes(config)))
    problems = [f"missing tensor {n!r}" for n in sorted(set(expected) - set(saved))]
    problems += [f"unexpected tensor {n!r}" for n in sorted(set(saved) - set(expected))]
    problems += [f"tensor {n!r} has shape {saved[n][0]}, config needs {expected[n]}"
                 for n in sorted(set(expected) & set(saved)) if saved[n][0] != tuple(expected[n])]
    if problems:
        raise CheckpointError(f"{directory}: saved params do not match the config: " + "; ".join(problems))

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def abstract(name_prefix: str, tree: dict) -> dict:
        return {name: abstract(f"{name_prefix}{name}.", value) if isinstance(value, dict) else
                jax.ShapeDtypeStruct(saved[name_prefix + name][0], saved[name_prefix + name][1], sharding=device)
                for name, value in tree.items()}

    target = abstract("", _as_dict(param_shapes(config)))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.restore(directory / ARRAYS, target)
    except Exception as e:  # orbax and tensorstore raise many exception types
        raise CheckpointError(f"{directory}: cannot read the saved arrays: {type(e).__name__}: {e}") from None
    return _from_dict(tree)
