"""Selection rules (wise_core.selection): the numpy references on hand-made masses; torch's and
JAX's select_blocks equal them on random and adversarial masses (top-k bitwise; threshold
except a block whose mass lies within float32 rounding of fraction * total); a user rule works
under jit with the config static; the decode-attention calls of every kernel runnable here
(reference, Triton and Pallas interpreted) select by the rule from their own masses; and
generate with a rule gives the tokens of generate whose every selection is computed by the
numpy reference (a host callback), in both frameworks."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import wise_jax
import wise_torch
from parity.cases import CONTEXT_RULES, selection_context_cases, top2_and_newest
from parity.impls import selectors
from wise_core import modes as M
from wise_core import reference as ref
from wise_core import rounding
from wise_core.checkpoint import random_tensors
from wise_core.config_error import ConfigError
from wise_core.presets import PRESETS
from wise_core.selection import Custom, Eta, SelectionContext, Threshold, TopK, as_rule, parse
from wise_core.wise_config import WiseConfig
from wise_jax import attention as jax_attention
from wise_torch import attention as torch_attention

SELECT = selectors("cpu")
RULES = (TopK(1), TopK(3), TopK(64), Threshold(0.05), Threshold(0.3), Threshold(1.0))


def assert_matches_spec(mass, rule, got, want):
    """got == want, except (threshold only) where a block's mass is within rounding of fraction *
    total: total is a float32 sum of n_blocks masses in any order (`rounding.selection_margin`)."""
    assert got.dtype == bool and got.shape == want.shape
    for *row, block in zip(*np.nonzero(got != want)):
        m = np.where(mass[tuple(row)] < np.finfo(np.float32).tiny, 0, mass[tuple(row)]).astype(np.float64)
        total = m.sum()
        assert isinstance(rule, Threshold), f"{rule}: row {row} block {block} differs"
        assert abs(m[block] - rule.fraction * total) <= rounding.selection_margin(m.size, total), (rule, row, block)


# -- the numpy references ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule, mass, want", [
    (TopK(2), [0.1, 0.4, 0.1, 0.4], [0, 1, 0, 1]),              # ties: the lower index first
    (TopK(2), [0.3, 0.3, 0.3, 0.1], [1, 1, 0, 0]),
    (TopK(9), [0.5, 0.0, 0.5], [1, 1, 1]),                       # k beyond the blocks: every block
    (TopK(1), [0.0, 0.0, 0.0], [1, 0, 0]),                       # all zero: the first, never empty
    (TopK(1), [0.0, 1e-40, 0.0], [1, 0, 0]),                     # a subnormal counts as zero
    (Threshold(0.25), [0.5, 0.25, 0.15, 0.1], [1, 1, 0, 0]),     # 0.25 >= 0.25 * 1.0 is kept
    (Threshold(0.9), [0.2, 0.5, 0.3], [0, 1, 0]),                # none reaches it: the first ranked
    (Threshold(0.01), [0.0, 0.0, 0.0], [1, 0, 0]),               # zero mass is never over a threshold
    (Threshold(0.5), [0.0, 1.0, 0.0], [0, 1, 0]),                # all mass in one block
    (Eta(0.5), [0.1, 0.4, 0.1, 0.4], [0, 1, 0, 1]),              # 0.4 before block 3 is < 0.5
])
def test_references_by_hand(rule, mass, want):
    np.testing.assert_array_equal(ref.select_blocks(np.array([mass], np.float32), rule)[0], np.array(want, bool))


def test_a_number_is_the_eta_rule():
    mass = np.random.default_rng(0).dirichlet(np.ones(16), 8).astype(np.float32)
    np.testing.assert_array_equal(ref.select_blocks(mass, 0.8), ref.select_blocks(mass, Eta(0.8)))
    assert as_rule(0.8) == Eta(0.8)


@pytest.mark.parametrize("rule", RULES + (Eta(0.9), Custom(lambda m: m > 0)))
@pytest.mark.parametrize("bad", [np.nan, -0.1, np.inf])
def test_reference_rejects_nan_and_negative_mass_as_the_eta_rule_does(rule, bad):
    with pytest.raises(ValueError, match="finite and non-negative"):
        ref.select_blocks(np.array([[0.5, bad, 0.5]], np.float32), rule)


@pytest.mark.parametrize("make, message", [
    (lambda: TopK(0), "k must be a positive integer"), (lambda: TopK(2.0), "k must be a positive integer"),
    (lambda: TopK(True), "k must be a positive integer"), (lambda: Threshold(0.0), r"fraction must be a number in \(0, 1\]"),
    (lambda: Threshold(float("nan")), "fraction must be"), (lambda: Eta(1.5), r"eta must be a number in \(0, 1\]"),
    (lambda: Custom(3), "fn must be callable"), (lambda: parse("top_k=x"), "'x' is not a integer"),
    (lambda: parse("topk=3"), "NAME=VALUE"), (lambda: as_rule("0.9"), "selection rule must be"),
])
def test_bad_rules_raise(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_parse():
    assert parse("top_k=4") == TopK(4) and parse("threshold=0.1") == Threshold(0.1) and parse("eta=0.9") == Eta(0.9)


# -- WiseConfig -------------------------------------------------------------------------------------
def test_config_default_is_the_eta_rule_and_validates_the_selection():
    assert WiseConfig().selection is None and WiseConfig(eta=0.8).rule == Eta(0.8)
    assert WiseConfig(selection=TopK(4)).rule == TopK(4)
    fn = lambda m: m > 0  # noqa: E731
    a, b = WiseConfig(selection=fn), WiseConfig(selection=Custom(fn))
    assert a == b and hash(a) == hash(b) and a.rule == Custom(fn)   # same function: same static argument
    assert WiseConfig(selection=lambda m: m > 0) != a                   # another function object: another
    with pytest.raises(ConfigError, match=r"give the eta rule as WiseConfig\(eta=0.9\)"):
        WiseConfig(selection=Eta(0.9))
    with pytest.raises(ConfigError, match="WiseConfig.selection must be None"):
        WiseConfig(selection="top_k=4")


# -- torch and JAX against the references -----------------------------------------------------------
VALUES = st.one_of(st.floats(0.0, 1.0, width=32), st.sampled_from([0.0, 0.125, 0.5, 1e-30, 2e-38, 1e-40]))


@st.composite
def masses(draw) -> np.ndarray:
    rows, n = draw(st.integers(1, 3)), draw(st.sampled_from([1, 5, 32]))  # few shapes: few compilations
    return np.array(draw(st.lists(VALUES, min_size=rows * n, max_size=rows * n)), np.float32).reshape(rows, n)


@settings(max_examples=40, deadline=None)
@given(masses(), st.sampled_from(RULES))
def test_frameworks_match_the_references(mass, rule):
    want = SELECT["numpy-spec"](mass, rule)
    for name in ("torch", "jax"):
        assert_matches_spec(mass, rule, SELECT[name](mass, rule), want)


ADVERSARIAL = {
    "ties": np.full((3, 8), 0.125, np.float32),
    "pairwise-ties": np.array([[0.3, 0.3, 0.2, 0.2], [0.1, 0.4, 0.1, 0.4]], np.float32),
    "zeros": np.zeros((2, 5), np.float32),
    "one-block": np.eye(6, dtype=np.float32),
    "subnormal": np.array([[0.0, 1e-40, 0.0], [1e-40, 2e-40, 0.0], [1e-39, 0.5, 1e-45]], np.float32),
    "huge": np.array([[1e30, 1e-30, 1e30, 0.0]], np.float32),
    "random": np.random.default_rng(1).dirichlet(np.full(128, 0.3), 16).astype(np.float32),
}


@pytest.mark.parametrize("case", list(ADVERSARIAL))
def test_frameworks_match_the_references_on_adversarial_masses(case):
    mass = ADVERSARIAL[case]
    for rule in RULES:
        want = SELECT["numpy-spec"](mass, rule)
        for name in ("torch", "jax"):
            assert_matches_spec(mass, rule, SELECT[name](mass, rule), want)


def test_custom_rule_in_each_framework_and_under_jit():
    """The same rule written for numpy, torch and jnp: the blocks holding >= 1/8 of the largest
    mass; the first ranked block is OR-ed in (an all-zero row keeps block 0)."""
    mass = np.concatenate([ADVERSARIAL["random"], ADVERSARIAL["zeros"][:, :1].repeat(128, 1)])
    want = ref.select_blocks(mass, Custom(lambda m: (m * 8 >= m.max(-1, keepdims=True)) & (m > 0)))
    assert want[-1, 0] and want[-1].sum() == 1
    got_torch = torch_attention.select_blocks(
        torch.from_numpy(mass), Custom(lambda m: (m * 8 >= m.amax(-1, keepdim=True)) & (m > 0)))
    np.testing.assert_array_equal(got_torch.numpy(), want)
    traces = []

    def fn(m):
        traces.append(1)
        return (m * 8 >= m.max(-1, keepdims=True)) & (m > 0)

    select = jax.jit(lambda m, config: jax_attention.select_blocks(m, config.rule), static_argnums=1)
    for _ in range(2):  # a config equal by fn's identity: one trace
        np.testing.assert_array_equal(np.asarray(select(jnp.asarray(mass), WiseConfig(selection=fn))), want)
    assert len(traces) == 1


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_custom_rule_of_the_wrong_shape_or_dtype_raises(framework):
    mass = np.full((2, 4), 0.25, np.float32)
    for bad in (lambda m: m, lambda m: (m > 0)[..., :2]):
        with pytest.raises(ValueError, match="it must return"):
            SELECT[framework](mass, Custom(bad))
    with pytest.raises(ValueError, match="it must return"):
        ref.select_blocks(mass, Custom(lambda m: m))


# -- decode-attention calls select by the rule ------------------------------------------------------
def _call_inputs(seed: int = 0, heads: int = 4, kv_heads: int = 2, head_dim: int = 32, block: int = 16):
    rng = np.random.default_rng(seed)
    page, pages = 32, 4
    seq_lens = np.array([1, 40, 97, 128, 70], np.int32)
    batch = len(seq_lens)
    k = (rng.standard_normal((batch * pages, page, kv_heads, head_dim)) * 2).astype(np.float32)
    v = rng.standard_normal((batch * pages, page, kv_heads, head_dim)).astype(np.float32)
    q = (rng.standard_normal((batch, heads, head_dim)) * 2).astype(np.float32)
    table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    modes = np.array([M.DISCOVER, M.DISCOVER_UNION, M.DISCOVER, M.SPARSE, M.DENSE], np.int32)
    support = rng.random((batch, heads, pages * page // block)) < 0.5
    support[:, :, 0] = True  # a SPARSE row attends at least one causal block
    return dict(q=q, k_pages=k, v_pages=v, page_table=table, seq_lens=seq_lens, modes=modes, support=support), block


def _expected_support(args, mass, rule):
    want = args["support"].copy()
    for b, mode in enumerate(args["modes"]):
        if mode in (M.DISCOVER, M.DISCOVER_UNION):
            chosen = ref.select_blocks(mass[b], rule)
            want[b] = chosen | want[b] if mode == M.DISCOVER_UNION else chosen
    return want


@pytest.mark.parametrize("rule", [TopK(2), Threshold(0.2)])
@pytest.mark.parametrize("framework, kernel", [("torch", "reference"), ("torch", "triton"),
                                               ("jax", "reference"), ("jax", "pallas")])
def test_decode_attention_selects_by_the_rule_from_its_own_mass(framework, kernel, rule):
    args, block = _call_inputs()
    if framework == "torch":
        t = {name: torch.from_numpy(x.copy()) for name, x in args.items()}
        out, support, mass = torch_attention.decode_attention(*t.values(), block_size=block, eta=0.95,
                                                              return_mass=True, kernel=kernel, selection=rule)
        eta_out, _ = torch_attention.decode_attention(*{n: torch.from_numpy(x.copy()) for n, x in args.items()}.values(),
                                                      block_size=block, eta=0.95, kernel=kernel)
        assert support is t["support"]  # in place, as the eta rule's call
    else:
        out, support, mass = jax_attention.decode_attention(*map(jnp.asarray, args.values()), block_size=block,
                                                            eta=0.95, return_mass=True, kernel=kernel,
                                                            selection=rule)
        eta_out, _ = jax_attention.decode_attention(*map(jnp.asarray, args.values()), block_size=block, eta=0.95,
                                                    kernel=kernel)
    mass, support = np.asarray(mass), np.asarray(support)
    want = _expected_support(args, mass, rule)
    assert_matches_spec(mass, rule, support, want)
    assert not np.array_equal(want, _expected_support(args, mass, Eta(0.95)))  # the rule made a difference
    np.testing.assert_array_equal(np.asarray(out), np.asarray(eta_out))  # the output does not depend on it


# -- generate with a rule = generate selecting by the numpy reference -------------------------------
def _numpy_rule_for_jax(rule):
    """The numpy reference of `rule` as a JAX host callback: a Custom rule of jnp arrays."""
    def fn(mass):
        return jax.pure_callback(lambda m: ref.select_blocks(np.asarray(m), rule),
                                 jax.ShapeDtypeStruct(mass.shape, jnp.bool_), mass)
    return Custom(fn, f"numpy {rule.describe()}")


def _numpy_rule_for_torch(rule):
    return Custom(lambda mass: torch.from_numpy(ref.select_blocks(mass.cpu().numpy(), rule)).to(mass.device),
                  f"numpy {rule.describe()}")


CONFIG = PRESETS["test-tiny"]
TENSORS = random_tensors(CONFIG, seed=4, std=0.08)
PROMPTS = [np.random.default_rng(0).integers(0, 256, n).tolist() for n in (70, 100)]
GEN_RULES = [TopK(2), Threshold(0.3)]


@pytest.fixture(scope="module")
def jax_params():
    return wise_jax.from_checkpoint_tensors(CONFIG, TENSORS)


@pytest.fixture(scope="module")
def torch_model():
    return wise_torch.from_tensors(CONFIG, TENSORS)


@pytest.mark.parametrize("rule", GEN_RULES)
def test_jax_generate_with_a_rule_is_generate_by_the_numpy_reference(jax_params, rule):
    def run(selection):
        return wise_jax.generate(jax_params, CONFIG, PROMPTS, max_new_tokens=4, page_size=32, eos_token_id=None,
                                 wise_config=WiseConfig(block_size=16, selection=selection))
    got, want = run(rule), run(_numpy_rule_for_jax(rule))
    assert got.tokens == want.tokens and got.stats.fallbacks == 0
    assert got.stats.density == want.stats.density and all(d < 1 for d in got.stats.density.values())


@pytest.mark.parametrize("rule", GEN_RULES)
def test_torch_generate_with_a_rule_is_generate_by_the_numpy_reference(torch_model, rule):
    def run(selection):
        return wise_torch.generate(torch_model, PROMPTS, max_new_tokens=4, page_size=32, eos_token_id=None,
                                   wise_config=WiseConfig(block_size=16, selection=selection))
    got, want = run(rule), run(_numpy_rule_for_torch(rule))
    assert got.tokens == want.tokens and got.stats.fallbacks == 0
    assert got.stats.density == want.stats.density and all(d < 1 for d in got.stats.density.values())


def test_top_k_of_every_block_is_dense_decode(torch_model):
    """TopK(k >= the blocks) selects every block: the reuse loops' SPARSE rows then attend what
    DENSE does, so the tokens are dense decode's."""
    wise = WiseConfig(block_size=16, selection=TopK(64))
    dense = wise_torch.generate(torch_model, PROMPTS, max_new_tokens=4, page_size=32, eos_token_id=None)
    sparse = wise_torch.generate(torch_model, PROMPTS, max_new_tokens=4, page_size=32, eos_token_id=None,
                                 wise_config=wise)
    assert sparse.tokens == dense.tokens and sparse.stats.fallbacks == 0
    assert all(d == 1 for d in sparse.stats.density.values())


# -- rules that read a SelectionContext -------------------------------------------------------------
def _numpy_context(seq_lens, n_blocks, *, loop=0, layer=0, heads=1, block_size=32):
    return SelectionContext(seq_lens=np.asarray(seq_lens, np.int32), loop=np.int32(loop), layer=np.int32(layer),
                            head=np.arange(heads, dtype=np.int32), block=np.arange(n_blocks, dtype=np.int32),
                            block_size=block_size)


TOP2_AND_NEWEST = Custom(top2_and_newest, "top2+newest", context=True)


def test_a_context_rule_by_hand_and_the_one_argument_form():
    mass = np.array([[[0.1, 0.4, 0.2, 0.3, 0.0]], [[0.1, 0.4, 0.2, 0.3, 0.0]]], np.float32)   # [batch 2, 1 head, 5]
    got = ref.select_blocks(mass, TOP2_AND_NEWEST, _numpy_context([97, 65], 5))
    np.testing.assert_array_equal(got[:, 0], [[0, 1, 0, 1, 0], [0, 1, 1, 1, 0]])   # top 2 = {1, 3}; newest 3, 2
    table = Custom(lambda m, ctx: ctx.rank < 1 + ctx.layer, "top-(1+layer)", context=True)
    assert ref.select_blocks(mass, table, _numpy_context([160, 160], 5, layer=2))[0, 0].tolist() == \
        [False, True, True, True, False]
    with pytest.raises(ValueError, match=r"rule 'top2\+newest' reads a SelectionContext .* but this call passes none"):
        ref.select_blocks(mass, TOP2_AND_NEWEST)
    one = Custom(lambda m: m >= 0.3)                                              # the one-argument form
    assert ref.select_blocks(mass, one, _numpy_context([97, 65], 5))[0, 0].tolist() == [0, 1, 0, 1, 0]
    assert TOP2_AND_NEWEST != Custom(top2_and_newest, "top2+newest")               # context is part of the rule
    assert TOP2_AND_NEWEST == Custom(top2_and_newest, "top2+newest", context=True)
    with pytest.raises(ValueError, match="context must be True or False"):
        Custom(top2_and_newest, context=1)


@pytest.mark.parametrize("case", selection_context_cases(), ids=lambda c: c.name)
def test_context_rules_in_both_frameworks_equal_the_reference(case):
    """Rank-based rules: no sum, bitwise (JAX's loop and layer traced; parity's selection-context)."""
    for rule in CONTEXT_RULES:
        want = SELECT["numpy-spec"](case.mass, rule, case.context)
        for name in ("torch", "jax"):
            np.testing.assert_array_equal(SELECT[name](case.mass, rule, case.context), want, err_msg=name)


def test_torch_decode_hands_each_discovery_call_its_context(torch_model):
    """generate with a context rule: every discovery call (loops 0 and 1, each layer) gets its
    loop, layer, rows' seq_lens, heads and blocks; the tokens are those of the numpy reference
    selecting with the same context."""
    seen = []

    def recording(mass, ctx):
        seen.append((int(ctx.loop), int(ctx.layer), ctx.seq_lens.tolist(), ctx.head.tolist(), ctx.block.tolist(),
                     mass.shape[-1], ctx.block_size))
        return top2_and_newest(mass, ctx)

    def numpy_reference(mass, ctx):
        fields = {n: getattr(ctx, n).cpu().numpy() for n in ("seq_lens", "loop", "layer", "head", "block")}
        context = SelectionContext(block_size=ctx.block_size, **fields)
        return torch.from_numpy(ref.select_blocks(mass.cpu().numpy(), TOP2_AND_NEWEST, context))

    def run(fn):
        return wise_torch.generate(torch_model, PROMPTS[:1], max_new_tokens=3, page_size=32, eos_token_id=None,
                                   wise_config=WiseConfig(block_size=16,
                                                          selection=Custom(fn, "rule", context=True)))
    got = run(recording)
    assert got.tokens == run(numpy_reference).tokens and got.stats.fallbacks == 0
    layers = CONFIG.num_hidden_layers
    assert [(loop, layer) for loop, layer, *_ in seen] == [(lp, ly) for _ in range(2) for lp in (0, 1)
                                                            for ly in range(layers)]   # 2 decode steps
    assert [s[2][0] for s in seen] == [71] * 2 * layers + [72] * 2 * layers   # the row's keys: its position + 1
    assert {tuple(s[3]) for s in seen} == {tuple(range(CONFIG.num_attention_heads))}
    assert {(tuple(s[4]), s[5], s[6]) for s in seen} == {(tuple(range(6)), 6, 16)}   # the step's 3 pages of 2 blocks
