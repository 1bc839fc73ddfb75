"""wise_jax.LLM on Huginn beyond the shared engine tests (tests/wise_core/engine/
test_engine_huginn.py, which run each case on both frameworks: a checkpoint directory by path,
huginn-0125's head_dim on the Pallas kernel, an Ouro or a bad num_steps refused): a mesh is
refused."""

import jax
import numpy as np
import pytest

from huginn_cases import TINY
from wise_core.checkpoint import random_tensors
from wise_jax import LLM, from_checkpoint_tensors


def test_a_mesh_is_refused():
    params = from_checkpoint_tensors(TINY, random_tensors(TINY, seed=0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="a mesh runs Ouro models only; this is a Huginn model"):
        LLM(params, TINY, num_pages=4, page_size=32, mesh=mesh)
