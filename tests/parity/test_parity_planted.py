"""Planted differences: one perturbed weight in torch's copy, one flipped support bit in a decode
call, one flipped bit of a selection. Each fails the check it should, with a message naming it,
while the checks it should not touch still pass."""

import dataclasses

import torch

from parity import cases
from parity.checks import CHECKS
from parity.impls import Impl, selectors
from parity.suite import Settings, Suite


def narrowed(**changes) -> Settings:
    return dataclasses.replace(Settings.for_machine(quick=True), **changes)


def failures(suite: Suite, check: str) -> list:
    results = CHECKS[check].run(suite)
    assert results and all(r.passed is not None for r in results), [r.detail for r in results]
    return [r for r in results if r.passed is False]


def test_perturbed_torch_weight_fails_checkpoint_and_end_to_end():
    base = Settings.for_machine(quick=True)
    suite = Suite(dataclasses.replace(base, e2e=tuple(r for r in base.e2e if r.model == "test-tiny-gqa"
                                                            and r.torch_kernel == "reference")), impls=[])
    with torch.no_grad():
        suite.torch_model("test-tiny-gqa").model.layers[1].mlp.down_proj.weight[5, 7] += 0.05

    [bad] = failures(suite, "checkpoint")  # the bf16 copy was not touched
    assert (bad.impl, bad.case, bad.dtype, bad.measured) == ("torch|jax", "test-tiny-gqa", "float32", 1)
    assert bad.detail.startswith("torch model.layers.1.mlp.down_proj.weight: 1 of 32768 values differ, first at [5, 7]")
    assert "jax" not in bad.detail

    e2e = failures(suite, "end-to-end")
    assert sorted(r.case for r in e2e) == ["test-tiny-gqa dense", "test-tiny-gqa wise"]
    for r in e2e:
        assert r.measured > r.bound and f"logits differ by {r.measured:.3g} > bound {r.bound:.3g}" in r.detail
    assert not failures(suite, "convert")  # the live (perturbed) weights still convert losslessly


@dataclasses.dataclass(frozen=True)
class FlipOneBit(Impl):
    """An implementation whose calls see support[row, head, block] flipped."""

    row: int = 2
    head: int = 0
    block: int = 1

    def decode(self, arrays, modes, support, **kwargs):
        support = support.copy()
        support[self.row, self.head, self.block] ^= True
        return super().decode(arrays, modes, support, **kwargs)


def test_flipped_support_bit_fails_all_blocks_and_masked_attention():
    case = cases.attention_cases(quick=True)[1]  # GQA; row 2 holds 97 keys, sparse in the mixed call
    suite = Suite(narrowed(attention_cases=(case,), attention_dtypes=("float32",)),
                  impls=[FlipOneBit("torch", "reference"), Impl("jax", "reference")])

    [bad] = failures(suite, "all-blocks-call")
    assert bad.impl == "torch-reference"
    assert "sparse-all vs dense: " in bad.detail and " values differ, first at [2, 0, " in bad.detail
    assert "discover vs dense" not in bad.detail  # DISCOVER ignores the support it is given

    masked = failures(suite, "masked-attention")
    assert sorted(r.impl for r in masked) == ["torch-reference", "torch-reference|jax-reference"]
    assert all(r.detail.endswith("rows over their bound: [2]") for r in masked)
    assert not failures(suite, "discover-mass")


def test_flipped_selection_bit_fails_selection_spec_with_margin():
    spec = selectors("cpu")

    def flipped(mass, eta):
        support = spec["torch"](mass, eta).copy()
        support[0, -1] ^= True
        return support

    suite = Suite(narrowed(), impls=[], selectors={"numpy-spec": spec["numpy-spec"], "torch": flipped,
                                                   "jax": spec["jax"]})
    results = {r.impl: r for r in CHECKS["selection-spec"].run(suite)}
    bad = results["torch vs numpy-spec"]
    assert bad.passed is False and bad.measured >= 1
    assert bad.detail.startswith("dirichlet-n1-eta0.95: row [0] block 0 dropped (spec: kept): mass ranked before "
                                 "it 0 vs eta*total 0.95")
    assert results["jax vs numpy-spec"].passed
