"""Selection rules: which blocks a discovery loop keeps, from the block mass of one (row, head).

A rule is a frozen (hashable) dataclass, so a `WiseConfig` holding one stays a static jit
argument. Every rule reads mass float32[..., n_blocks] (masses below float32's smallest normal
number count as zero) and ranks the blocks by mass, descending, ties to the lower index; every
rule keeps the block ranked first, so a support is never empty.

- `Eta(eta)`: the smallest ranked prefix whose mass reaches eta of the total (WISE's rule,
  `WiseConfig(eta=...)`, what the GPU kernels compute in their finish step).
- `TopK(k)`: the k blocks ranked first (every block when there are fewer).
- `Threshold(fraction)`: every block of non-zero mass >= fraction * total, total being the
  running sum of the ranked masses (the eta rule's total).
- `Custom(fn, name)`: a user function fn(mass float32[..., n_blocks]) -> bool[..., n_blocks],
  called with the array type of the framework running it (numpy for the reference, a traced
  jax.Array under jit, a torch.Tensor), and must treat each (row, head) on its own (tensor
  parallelism splits the heads); the block ranked first is OR-ed in. It hashes and
  compares by `fn`'s identity: pass the same function object to reuse a compilation.
  `Custom(fn, name, context=True)`: fn(mass, context) also reads a `SelectionContext` -- each
  row's keys, the loop, the layer, the head and block indices and each block's rank, arrays
  of the same framework -- so "the top-k blocks and the newest one" or a per-layer table can be
  written once for every framework:

      def top2_and_newest(mass, ctx):     # mass [batch, heads, n_blocks] in a decode step
          newest = (ctx.seq_lens - 1) // ctx.block_size
          return (ctx.rank < 2) | (ctx.block[None, None, :] == newest[:, None, None])

The numpy references are `wise_core.reference.select_blocks(mass, rule)`; wise_torch and wise_jax
implement each rule in their `attention.select_blocks`.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SelectionRule:
    """Base of the selection rules (`Eta`, `TopK`, `Threshold`, `Custom`)."""

    name: str = ""

    def describe(self) -> str:
        """A short label, e.g. 'eta=0.95', 'top_k=4'."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Eta(SelectionRule):
    """Keep the smallest ranked prefix whose mass reaches eta of the total; eta in (0, 1]."""

    eta: float
    name = "eta"

    def __post_init__(self) -> None:
        if not isinstance(self.eta, numbers.Real) or isinstance(self.eta, bool) or not 0.0 < self.eta <= 1.0:
            raise ValueError(f"Eta: eta must be a number in (0, 1], got {self.eta!r}")
        object.__setattr__(self, "eta", float(self.eta))

    def describe(self) -> str:
        return f"eta={self.eta:g}"


@dataclasses.dataclass(frozen=True)
class TopK(SelectionRule):
    """Keep the k blocks of highest mass (ties to the lower index); k a positive integer."""

    k: int
    name = "top_k"

    def __post_init__(self) -> None:
        if not _is_int(self.k) or self.k < 1:
            raise ValueError(f"TopK: k must be a positive integer (a Python int), got {self.k!r}")

    def describe(self) -> str:
        return f"top_k={self.k}"


@dataclasses.dataclass(frozen=True)
class Threshold(SelectionRule):
    """Keep every block of non-zero mass >= fraction * total (and the block ranked first);
    fraction in (0, 1]."""

    fraction: float
    name = "threshold"

    def __post_init__(self) -> None:
        f = self.fraction
        if not isinstance(f, numbers.Real) or isinstance(f, bool) or not 0.0 < f <= 1.0:
            raise ValueError(f"Threshold: fraction must be a number in (0, 1], got {f!r}")
        object.__setattr__(self, "fraction", float(f))

    def describe(self) -> str:
        return f"threshold={self.fraction:g}"


@dataclasses.dataclass(frozen=True)
class SelectionContext:
    """What a `Custom(..., context=True)` rule reads beside the block masses of a decode call,
    every array of the framework running it (numpy, jax -- loop and layer may be traced --, torch):

    seq_lens int[batch]: the keys each row attends (its position + 1; a row's newest block is
    (seq_lens - 1) // block_size); loop, layer int32[] (0-d arrays: the decode step's loop and
    layer); head int32[heads]: the index of each head along the masses' heads axis (under
    tensor parallelism a device's own heads, numbered from 0); block int32[n_blocks]: 0, 1, ...;
    rank int32[batch, heads, n_blocks]: each block's rank by mass (0 the largest, ties to the
    lower index; filled by select_blocks, None where a context is built); block_size: keys per
    block (a Python int)."""

    seq_lens: Any
    loop: Any
    layer: Any
    head: Any
    block: Any
    block_size: int
    rank: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class Custom(SelectionRule):
    """A user rule: fn(mass float32[..., n_blocks]) -> bool[..., n_blocks] of the same shape,
    in the calling framework's array type, or with context=True fn(mass, SelectionContext); the
    block ranked first is always kept. Equal and hashed by the identity of fn, the label and
    the context flag (a static jit argument then retraces only for a new fn)."""

    fn: Callable
    label: str = "custom"
    context: bool = False
    name = "custom"

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"Custom: fn must be callable, got {self.fn!r}")
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"Custom: label must be a non-empty string, got {self.label!r}")
        if not isinstance(self.context, bool):
            raise ValueError(f"Custom: context must be True or False, got {self.context!r}")

    def __eq__(self, other) -> bool:
        return (isinstance(other, Custom) and other.fn is self.fn and other.label == self.label
                and other.context == self.context)

    def __hash__(self) -> int:
        return hash((Custom, id(self.fn), self.label, self.context))

    def choose(self, mass, context: SelectionContext | None):
        """fn's choice for `mass` (with `context`, which a context rule must be given)."""
        if not self.context:
            return self.fn(mass)
        if context is None:
            raise ValueError(f"selection rule {self.label!r} reads a SelectionContext (Custom(..., context=True)) "
                             f"but this call passes none")
        return self.fn(mass, context)

    def describe(self) -> str:
        return self.label


RULES = {"eta": Eta, "top_k": TopK, "threshold": Threshold}
"""The built-in rules by name (`parse`)."""


def as_rule(rule) -> SelectionRule:
    """A SelectionRule as it is; a number as `Eta(number)` (the `select_blocks(mass, eta)` form)."""
    if isinstance(rule, SelectionRule):
        return rule
    if isinstance(rule, numbers.Real) and not isinstance(rule, bool):
        return Eta(rule)
    raise TypeError(f"a selection rule must be a wise_core.selection rule (Eta, TopK, Threshold, Custom) "
                    f"or an eta number, got {rule!r}")


def parse(spec: str) -> SelectionRule:
    """'eta=0.95', 'top_k=4', 'threshold=0.01' -> the rule (command-line form)."""
    name, sep, value = str(spec).partition("=")
    if not sep or name not in RULES:
        raise ValueError(f"a selection rule is NAME=VALUE with NAME one of {sorted(RULES)}, got {spec!r}")
    try:
        number = int(value) if name == "top_k" else float(value)
    except ValueError:
        raise ValueError(f"selection rule {spec!r}: {value!r} is not a "
                         f"{'integer' if name == 'top_k' else 'number'}") from None
    return RULES[name](number)
