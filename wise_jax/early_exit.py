"""Ouro's per-token early exit over one pass of the loops (the rule: `wise_core.ouro_reference`).

`ExitState` follows a step's rows through the loops of `wise_jax.model`: after each loop but the
last, `end_loop` adds the loop's exit probability to each row's cumulative one (float32, summed
as the released code does) and marks the rows that reach `early_exit_threshold`, keeping their
normed state of that loop. Rows that exited ride along masked (static shapes, one program per
bucket): their later results are discarded (`output` reads the exit loop's state) and in decode
`store_kv` makes them write, at each later loop, the previous loop's K/V at their position (so the
exit loop's: the latest computed iteration of that position). Prefill runs every loop for every
token; only its logits are the exit loop's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["total", "remaining", "exited", "exit_loop", "state"],
                   meta_fields=["loops", "threshold"])
@dataclasses.dataclass(frozen=True)
class ExitState:
    """Per row (shape `rows`, any leading dims): total and remaining float32 (cumulative exit
    probability, mass not yet exited), exited bool, exit_loop int32 (the last loop until the row
    exits), state [*rows, hidden] (the exit loop's normed state where exited)."""

    loops: int
    threshold: float
    total: jax.Array
    remaining: jax.Array
    exited: jax.Array
    exit_loop: jax.Array
    state: jax.Array

    @classmethod
    def create(cls, h: jax.Array, loops: int, threshold: float) -> "ExitState":
        """For rows of states like h [*rows, hidden]; threshold in [0, 1)."""
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"ExitState needs an early_exit_threshold in [0, 1), got {threshold}")
        rows = h.shape[:-1]
        return cls(loops, threshold, jnp.zeros(rows, jnp.float32), jnp.ones(rows, jnp.float32),
                   jnp.zeros(rows, bool), jnp.full(rows, loops - 1, jnp.int32), jnp.zeros_like(h))

    def end_loop(self, loop: int | jax.Array, h: jax.Array, lam: jax.Array) -> "ExitState":
        """After loop `loop` (a Python int or a traced int32[]) with normed states h [*rows,
        hidden] and gate probabilities lam float32[*rows]: the rows whose cumulative exit
        probability reaches the threshold exit here (none after the last loop, which every
        remaining row ends at)."""
        if isinstance(loop, int) and loop == self.loops - 1:
            return self
        total = self.total + lam * self.remaining
        now = ~self.exited & (total >= self.threshold) & (loop < self.loops - 1)
        return dataclasses.replace(self, total=total, remaining=self.remaining * (1.0 - lam),
                                   exited=self.exited | now, exit_loop=jnp.where(now, loop, self.exit_loop),
                                   state=jnp.where(now[..., None], h, self.state))

    def store_kv(self, k, v, k_before, v_before) -> tuple:
        """A loop's new k, v [rows, kv_heads, head_dim] -> what each row writes: the previous
        loop's (k_before, v_before at its position) where it exited. Each may be a cache's entries
        (`kv_cache.encode`, `read_token`): an fp8 cache's (codes [rows, kv_heads, head_dim], scales
        [rows, kv_heads]) pairs, chosen alike."""
        def pick(new, old):
            keep = self.exited.reshape(self.exited.shape + (1,) * (new.ndim - self.exited.ndim))
            return jnp.where(keep, old, new)
        return jax.tree.map(pick, k, k_before), jax.tree.map(pick, v, v_before)

    def output(self, h: jax.Array) -> jax.Array:
        """h [*rows, hidden], the last loop's normed states -> each row's exit loop's."""
        return jnp.where(self.exited[..., None], self.state, h)
