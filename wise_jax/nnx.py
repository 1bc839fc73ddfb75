"""A Flax NNX view of the Ouro model (`Ouro`) over the functional model's parameters.

The module holds one `nnx.Param` per leaf of `wise_jax.params.Params` (the same names, the same
stacked-layer layout) and no maths of its own: every method assembles the `Params` pytree from
its variables (`to_params`) and calls the functional model (`wise_jax.model`,
`wise_jax.train.loop_losses`), so the two compute the same thing bitwise. `from_params` /
`to_params` hand the arrays over as they are (no copy, no cast), so conversion is exact both
ways. Fine-tune with `nnx.Optimizer(model, optax..., wrt=nnx.Param)`; insert adapters by
subclassing and overriding `to_params` (e.g. adding a low-rank update to a layer field).

Per-loop states: the functional model exposes the exit distribution over loops
(`forward_with_exits`) and the next-token cross-entropy after every loop (`loop_losses`); it
does not return the hidden state of each loop, so neither does this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from wise_core.model_config import ModelConfig
from wise_jax import model as wm
from wise_jax.params import LAYER_NAMES, LayerParams, Params, init_params
from wise_jax.train import loop_losses


class Layers(nnx.Module):
    """The stacked weights of every layer (`LayerParams`), one `nnx.Param` per field."""

    def __init__(self, layers: LayerParams):
        if isinstance(layers, tuple):
            raise ValueError("Ouro holds stacked layers; pass params before `unstack_layers` "
                             "(or after `stack_layers`)")
        for name in LAYER_NAMES:
            setattr(self, name, nnx.Param(getattr(layers, name)))

    def to_params(self) -> LayerParams:
        return LayerParams(**{name: getattr(self, name).get_value() for name in LAYER_NAMES})


class Ouro(nnx.Module):
    """Ouro as an NNX module. `Ouro(config, rngs=nnx.Rngs(0))` initialises as
    `wise_jax.params.init_params` does (normal(0, std) matrices, unit norms, in `dtype`) from
    `rngs.params()`; `Ouro(config, params)` (`from_params`) wraps existing weights."""

    def __init__(self, config: ModelConfig, params: Params | None = None, *, rngs: nnx.Rngs | None = None,
                 dtype=jnp.float32, std: float = 0.02):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if (params is None) == (rngs is None):
            raise ValueError("Ouro takes either params (existing weights) or rngs (fresh ones), not both or none")
        if params is None:
            params = init_params(config, rngs.params(), dtype, std=std)
        elif not isinstance(params, Params):
            raise TypeError(f"params must be a wise_jax.params.Params, got {type(params).__name__}")
        self.config = config
        self.embed_tokens = nnx.Param(params.embed_tokens)
        self.layers = Layers(params.layers)
        self.norm = nnx.Param(params.norm)
        self.early_exit_gate = nnx.Param(params.early_exit_gate)
        self.early_exit_gate_bias = nnx.Param(params.early_exit_gate_bias)
        self.lm_head = None if params.lm_head is None else nnx.Param(params.lm_head)

    @classmethod
    def from_params(cls, params: Params, config: ModelConfig) -> "Ouro":
        """The module over `params` (arrays taken as they are: `to_params` gives them back)."""
        return cls(config, params)

    def to_params(self) -> Params:
        """The functional `Params` pytree of the module's current values."""
        return Params(embed_tokens=self.embed_tokens.get_value(), layers=self.layers.to_params(),
                      norm=self.norm.get_value(), early_exit_gate=self.early_exit_gate.get_value(),
                      early_exit_gate_bias=self.early_exit_gate_bias.get_value(),
                      lm_head=None if self.lm_head is None else self.lm_head.get_value())

    def __call__(self, input_ids: jax.Array, *, remat: bool = False, attention: str = "auto") -> jax.Array:
        """input_ids int32[batch, seq] -> logits float32[batch, seq, vocab] (`wise_jax.model.forward`)."""
        return wm.forward(self.to_params(), self.config, input_ids, remat=remat, attention=attention)

    def forward_with_exits(self, input_ids: jax.Array, *, remat: bool = False, attention: str = "auto"
                           ) -> tuple[jax.Array, jax.Array]:
        """(logits [batch, seq, vocab], exit probabilities [loops, batch, seq])
        (`wise_jax.model.forward_with_exits`)."""
        return wm.forward_with_exits(self.to_params(), self.config, input_ids, remat=remat, attention=attention)

    def loop_losses(self, tokens: jax.Array, *, remat: bool = False) -> tuple[jax.Array, jax.Array]:
        """tokens int32[batch, seq + 1] -> (ce [loops, batch, seq], p [loops, batch, seq]): the
        next-token cross-entropy after every loop and the exit distribution
        (`wise_jax.train.loop_losses`)."""
        return loop_losses(self.to_params(), self.config, tokens, remat=remat)
