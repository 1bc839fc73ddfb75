"""wise_jax.model: the forward against a float64 numpy transcription of the Ouro equations, its
input checks, prefill / insert / paged decode against the forward, teacher_force, gradients. fp32;
tolerances per assertion."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wise_jax
from wise_core import ouro_reference, rounding
from wise_core.checkpoint import random_tensors
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_jax import kv_cache as kvc
from wise_jax import model, wise_state


def _setup(name):
    config = PRESETS[name]
    tensors = random_tensors(config, seed=1, std=0.08)
    return config, tensors, wise_jax.from_checkpoint_tensors(config, tensors)


@pytest.fixture(scope="module")
def tiny():
    return _setup("test-tiny")


@pytest.fixture(scope="module")
def gqa():
    return _setup("test-tiny-gqa")


def numpy_forward(config, t, ids, positions=None, segment_ids=None):
    """Ouro per docs/DESIGN.md "Model", in float64 from the HF-named tensors: (logits, lambdas).
    positions: the RoPE positions (None: 0..seq-1); segment_ids: a token attends to the earlier
    tokens of its own id only (None: one segment)."""
    seq, heads, kv_heads, dim = len(ids), config.num_attention_heads, config.num_key_value_heads, config.head_dim
    w = {k: v.astype(np.float64) for k, v in t.items()}
    positions = np.arange(seq) if positions is None else np.asarray(positions)
    segments = np.zeros(seq, int) if segment_ids is None else np.asarray(segment_ids)
    mask = np.where(np.tril(segments[:, None] == segments[None, :]), 0.0, -np.inf)

    def norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps) * weight

    angles = positions[:, None] * config.rope_theta ** (-np.arange(0, dim, 2) / dim)
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]

    def rope(x):
        x1, x2 = np.split(x, 2, -1)
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    h, lambdas = w["model.embed_tokens.weight"][ids], []
    for _ in range(config.total_ut_steps):
        for n in range(config.num_hidden_layers):
            p = {k[len(f"model.layers.{n}."):]: v for k, v in w.items() if k.startswith(f"model.layers.{n}.")}
            x = norm(h, p["input_layernorm.weight"])
            q = rope((x @ p["self_attn.q_proj.weight"].T).reshape(seq, heads, dim))
            k = np.repeat(rope((x @ p["self_attn.k_proj.weight"].T).reshape(seq, kv_heads, dim)), heads // kv_heads, 1)
            v = np.repeat((x @ p["self_attn.v_proj.weight"].T).reshape(seq, kv_heads, dim), heads // kv_heads, 1)
            s = np.einsum("qhd,khd->hqk", q, k) * dim ** -0.5 + mask
            probs = np.exp(s - s.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            o = np.einsum("hqk,khd->qhd", probs, v).reshape(seq, heads * dim)
            h = h + norm(o @ p["self_attn.o_proj.weight"].T, p["input_layernorm_2.weight"])
            x = norm(h, p["post_attention_layernorm.weight"])
            g = x @ p["mlp.gate_proj.weight"].T
            m = (g / (1 + np.exp(-g)) * (x @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T
            h = h + norm(m, p["post_attention_layernorm_2.weight"])
        h = norm(h, w["model.norm.weight"])
        z = h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"]
        lambdas.append(1 / (1 + np.exp(-z[:, 0])))
    return h @ w["lm_head.weight"].T, np.stack(lambdas)


def test_forward_matches_numpy_equations(gqa):
    config, tensors, params = gqa
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 24))
    logits, exits = jax.jit(wise_jax.forward_with_exits, static_argnums=1)(params, config, jnp.asarray(ids, jnp.int32))
    for b in range(2):
        ref_logits, lambdas = numpy_forward(config, tensors, ids[b])
        diff, bound = rounding.model_difference(logits[b], ref_logits, config, keys=24)  # fp32 vs numpy
        assert diff <= bound, (diff, bound)
        remaining, ref_exits = 1.0, []
        for lam in lambdas[:-1]:
            ref_exits.append(lam * remaining)
            remaining = remaining * (1 - lam)
        diff, bound = rounding.model_difference(exits[:, b], np.stack(ref_exits + [remaining]), config, keys=24)
        assert diff <= bound, (diff, bound)
    loops = config.total_ut_steps  # p sums to 1 exactly; float32 products and a sum of `loops` terms
    assert np.abs(np.asarray(exits.sum(0)) - 1.0).max() <= rounding.gamma(3 * loops)


@pytest.mark.parametrize("preset,page_size", [("test-tiny", 32), ("test-tiny-gqa", 64), ("test-tiny", 128)])
def test_prefill_insert_and_paged_decode_match_forward(preset, page_size, tiny, gqa):
    """Each row prefilled alone and inserted, then decoded together; a row past its length is an
    empty slot (-1): a masked no-op whose cache stays as it was."""
    config, _, params = tiny if preset == "test-tiny" else gqa
    rng = np.random.default_rng(page_size)
    lengths, prefix = np.array([80, 47, 9]), np.array([37, 1, 4])     # mixed lengths and positions
    tokens = rng.integers(0, config.vocab_size, (3, 80)).astype(np.int32)
    full = np.asarray(jax.jit(wise_jax.forward, static_argnums=1)(params, config, jnp.asarray(tokens)))
    max_pages = -(-96 // page_size)
    cache = kvc.create(config, batch=4, max_pages=max_pages, num_pages=3 * max_pages, page_size=page_size)
    for b in range(3):
        logits, kv = wise_jax.prefill(params, config, tokens[b, :prefix[b]], page_size=page_size)
        # fp32, different summation orders
        diff, bound = rounding.model_difference(logits, full[b, prefix[b] - 1], config, keys=80)
        assert diff <= bound, (diff, bound)
        cache = wise_jax.insert(cache, kv, b)
    for step in range(int((lengths - prefix).max())):
        position = prefix + step
        live = position < lengths
        fed = np.append(np.where(live, tokens[np.arange(3), np.minimum(position, 79)], 0), 0).astype(np.int32)
        tags = np.append(np.where(live, np.arange(3), -1), -1).astype(np.int32)
        if step == 10:
            held = np.asarray(cache.k).copy()
        logits, cache, _ = wise_jax.decode_step(params, config, cache, None, jnp.asarray(fed), jnp.asarray(tags),
                                                kernel="reference")
        diff, bound = rounding.model_difference(np.asarray(logits)[:3][live], full[np.arange(3)[live], position[live]],
                                                config, keys=80)
        assert diff <= bound, (step, diff, bound)
    assert not bool(cache.overflowed)
    assert np.asarray(cache.seq_lens).tolist() == lengths.tolist() + [0]
    pages = np.asarray(cache.page_table)[2, :1]       # row 2 finished at step 5: untouched since
    np.testing.assert_array_equal(np.asarray(cache.k)[:, pages], held[:, pages])


@pytest.mark.parametrize("ids,match", [
    ([[1, 384]], r"ids \[384\] outside the vocabulary \(size 384\)"),
    ([[-1, 2]], r"ids \[-1\] outside the vocabulary"),
    ([[0.5, 1.0]], "integer tensor with 2 dims"),
    ([1, 2], "integer tensor with 2 dims"),
])
def test_forward_rejects_bad_ids(tiny, ids, match):
    config, _, params = tiny
    ids = np.asarray(ids)
    with pytest.raises(ValueError, match=match):
        wise_jax.forward(params, config, jnp.asarray(ids, jnp.int32 if ids.dtype.kind == "i" else jnp.float32))


def test_forward_checks_the_length_and_traced_bad_ids_give_nan(tiny):
    config, _, params = tiny
    with pytest.raises(ValueError, match=r"sequence of 1025 tokens exceeds max_position_embeddings \(1024\)"):
        jax.jit(wise_jax.forward, static_argnums=1)(params, config, jnp.zeros((1, 1025), jnp.int32))
    forward = jax.jit(wise_jax.forward, static_argnums=1)
    for bad in (9000, -3):                                                   # not checkable under jit
        logits = np.asarray(forward(params, config, jnp.asarray([[5, 6, 7, bad, 8], [5, 6, 7, 8, 9]], jnp.int32)))
        assert np.isnan(logits[0, 3:]).all()                                # never a clamped id's logits
        assert np.isfinite(logits[1]).all()                                 # other rows unaffected


def test_teacher_force_matches_forward(tiny):
    config, _, params = tiny
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, config.vocab_size, n).tolist() for n in (50, 20)]
    split = [30, 12]
    out = wise_jax.teacher_force(params, config, [s[:c] for s, c in zip(seqs, split)],
                                 [s[c:] for s, c in zip(seqs, split)], page_size=32)
    padded = jnp.asarray([seqs[0], seqs[1] + [0] * 30])                # causal: padding changes nothing before it
    ref = np.asarray(jax.nn.log_softmax(jax.jit(wise_jax.forward, static_argnums=1)(params, config, padded), -1))
    for b, (s, c, logprobs) in enumerate(zip(seqs, split, out.logprobs)):
        diff, bound = rounding.model_difference(logprobs, ref[b, np.arange(c - 1, len(s) - 1), s[c:]], config, keys=50)
        assert diff <= bound, (diff, bound)
    assert out.stats.new_tokens == 28 and out.stats.fallbacks is None
    single = wise_jax.teacher_force(params, config, seqs[1][:12], seqs[1][12:], page_size=32)
    diff, bound = rounding.model_difference(single.logprobs[0], out.logprobs[1], config, keys=50)  # other batch
    assert diff <= bound, (diff, bound)


def test_gradients_with_and_without_remat(tiny):
    config, _, params = tiny
    config = dataclasses.replace(config, total_ut_steps=2)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (2, 33)), jnp.int32)

    def loss(params, remat):
        logits = wise_jax.forward(params, config, ids[:, :-1], remat=remat)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1).mean()

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    value, grads = value_and_grad(params, False)
    value_remat, grads_remat = value_and_grad(params, True)
    assert float(value) == pytest.approx(float(value_remat), abs=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_remat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads.layers.qkv_proj).max()) > 0
    stepped = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    assert float(jax.jit(loss, static_argnums=1)(stepped, False)) < float(value)     # a descent direction


@pytest.mark.parametrize("mode", ["dense", "wise"])
def test_decode_step_scanned_loops_match_straight_line_loops(gqa, mode):
    """scan_loops (each run of loops of one role a lax.scan of one body, the loop index traced)
    against every loop straight-line, with rows exiting early at different loops (threshold 0.6:
    exit loops 1..4 among these tokens) and a masked row: the same exit loops, WISE state (tags,
    supports, counters) and tokens; the logits within `rounding.model_bound` (fp32: the same
    operations, but XLA may fuse a scan body otherwise than straight-line code)."""
    config, _, params = gqa
    config = dataclasses.replace(config, early_exit_threshold=0.6)
    wise_config = None if mode == "dense" else WiseConfig(eta=0.5)
    rng = np.random.default_rng(3)
    batch, page_size, max_pages = 4, 32, 4
    runs = {}
    for scan_loops in (False, True):
        cache = kvc.create(config, batch=batch, max_pages=max_pages, num_pages=batch * max_pages, page_size=page_size)
        cache = dataclasses.replace(
            cache, k=jnp.asarray(rng.standard_normal(cache.k.shape), cache.k.dtype) * 0.5,
            v=jnp.asarray(rng.standard_normal(cache.v.shape), cache.v.dtype),
            page_table=jnp.arange(batch * max_pages, dtype=jnp.int32).reshape(batch, max_pages),
            seq_lens=jnp.asarray([70, 63, 33, 5], jnp.int32))
        rng = np.random.default_rng(3)          # both arms read the same cache contents
        state = None if wise_config is None else wise_state.create(
            wise_config, slots=batch, layers=config.num_hidden_layers, heads=config.num_attention_heads,
            max_blocks=max_pages * page_size // wise_config.block_size)
        step = jax.jit(functools.partial(model.decode_step, config=config, wise_config=wise_config,
                                         kernel="reference", allocate=False, return_depths=True,
                                         scan_loops=scan_loops))
        outputs = []
        for n in range(3):
            tokens = jnp.asarray([3 + n, 50 + n, 7, 11 + 2 * n], jnp.int32)
            tags = jnp.asarray([0, 1, -1, 3] if n == 1 else [0, 1, 2, 3], jnp.int32)
            logits, cache, state, depths = step(params, cache=cache, state=state, tokens=tokens, tags=tags)
            outputs.append((np.asarray(logits), np.asarray(depths)))
        runs[scan_loops] = outputs, jax.tree.map(np.asarray, state)
    (straight, state_a), (scanned, state_b) = runs[False], runs[True]
    assert len({int(d) for _, depths in straight for d in depths}) >= 2      # rows exit at different loops
    for n, ((logits_a, depths_a), (logits_b, depths_b)) in enumerate(zip(straight, scanned)):
        np.testing.assert_array_equal(depths_b, depths_a)
        live = [0, 1, 3] if n == 1 else [0, 1, 2, 3]
        np.testing.assert_array_equal(logits_b[live].argmax(-1), logits_a[live].argmax(-1))
        diff, bound = rounding.model_difference(logits_b[live], logits_a[live], config, keys=73)
        assert diff <= bound, (n, diff, bound)
    for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
        np.testing.assert_array_equal(b, a)


# -- positions, segment_ids, return_hidden --------------------------------------------------------
FORWARD = jax.jit(wise_jax.forward, static_argnames=("config", "return_hidden", "attention"))


def test_positions_and_packed_segments_match_numpy(gqa):
    """forward at given RoPE positions (a gap of 90 inside the row) and a row packing two
    sequences and a padding segment (positions restarting in each: `segment_positions`) against
    the float64 equations at those positions and masks, and each packed sequence against the
    equations and the JAX forward of it alone. fp32 against float64 or another summation order
    (a packed query also sums the zero weights of other segments' keys): `rounding.model_bound`,
    with the RoPE angles' rounding at the largest position (`rounding.rope_error`)."""
    config, tensors, params = gqa
    rng = np.random.default_rng(7)
    ids = rng.integers(0, config.vocab_size, 30).astype(np.int32)
    positions = np.concatenate([np.arange(10), 100 + np.arange(20)]).astype(np.int32)
    got = np.asarray(FORWARD(params, config, jnp.asarray(ids[None]), positions=jnp.asarray(positions[None])))[0]
    want, _ = numpy_forward(config, tensors, ids, positions=positions)
    diff, bound = rounding.model_difference(got, want, config, keys=30, positions=119)
    assert diff <= bound, (diff, bound)
    plain, _ = numpy_forward(config, tensors, ids)
    assert np.abs(got[10:] - plain[10:]).max() > 100 * bound       # the positions are used

    a, b = ids[:12], ids[12:26]
    segments = np.array([0] * 12 + [1] * 14 + [7] * 4, np.int32)   # the last 4: padding of its own
    packed = np.concatenate([a, b, np.zeros(4, np.int32)])
    seg_positions = model.segment_positions(jnp.asarray(segments[None]))
    assert np.asarray(seg_positions)[0].tolist() == list(range(12)) + list(range(14)) + list(range(4))
    for attention in ("chunked", "reference"):
        out = np.asarray(FORWARD(params, config, jnp.asarray(packed[None]), positions=seg_positions,
                                 segment_ids=jnp.asarray(segments[None]), attention=attention))[0]
        for seq, rows in ((a, slice(0, 12)), (b, slice(12, 26))):
            alone_np, _ = numpy_forward(config, tensors, seq)
            diff, bound = rounding.model_difference(out[rows], alone_np, config, keys=14)
            assert diff <= bound, (attention, diff, bound)
            alone = np.asarray(FORWARD(params, config, jnp.asarray(seq[None]), attention=attention))[0]
            diff, bound = rounding.model_difference(out[rows], alone, config, keys=14)
            assert diff <= bound, (attention, diff, bound)
    mixed, _ = numpy_forward(config, tensors, packed, positions=np.asarray(seg_positions)[0], segment_ids=segments)
    diff, bound = rounding.model_difference(out, mixed, config, keys=14)   # the padding segment too
    assert diff <= bound, (diff, bound)


def test_shifted_positions_give_the_same_logits_and_default_arguments_change_nothing(gqa):
    """RoPE attention depends on position differences only: every position shifted by 1000 (past
    max_position_embeddings: positions are not limited) gives the unshifted logits within
    `rounding.model_bound` with the angles' rounding at position 1023; a second sequence packed
    after the first at the default positions (12.., not restarted) gives its logits alone likewise.
    Explicit 0..seq-1 positions are the default's program: bitwise equal; one segment a row
    within rounding."""
    config, _, params = gqa
    ids = jnp.asarray(np.random.default_rng(8).integers(0, config.vocab_size, (2, 24)), jnp.int32)
    base = np.asarray(FORWARD(params, config, ids))
    arange = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))
    np.testing.assert_array_equal(np.asarray(FORWARD(params, config, ids, positions=arange)), base)
    shifted = np.asarray(FORWARD(params, config, ids, positions=arange + 1000))
    diff, bound = rounding.model_difference(shifted, base, config, keys=24, positions=1023)
    assert diff <= bound, (diff, bound)
    one = np.asarray(FORWARD(params, config, ids, segment_ids=jnp.zeros((2, 24), jnp.int32)))
    diff, bound = rounding.model_difference(one, base, config, keys=24)
    assert diff <= bound, (diff, bound)
    segments = jnp.asarray([[0] * 12 + [1] * 12, [3] * 24], jnp.int32)
    packed = np.asarray(FORWARD(params, config, ids, segment_ids=segments))
    second = np.asarray(FORWARD(params, config, ids[:1, 12:]))[0]
    diff, bound = rounding.model_difference(packed[0, 12:], second, config, keys=12, positions=23)
    assert diff <= bound, (diff, bound)
    diff, bound = rounding.model_difference(packed[1], base[1], config, keys=24)
    assert diff <= bound, (diff, bound)


def test_return_hidden_is_the_residual_stream_the_logits_read(gqa):
    """hidden [loops, batch, seq, hidden] in the params' dtype; the head over model.norm of the last
    loop's is the logits, bitwise (eager: the same operations), and of each token's exit loop's
    with early exit (threshold 0.6: tokens exit at different loops); loop 0's lens is a one-loop
    model's logits (another program: within rounding); the logits with return_hidden are those
    without it, and forward_with_exits returns the same hidden."""
    config, _, params = gqa
    ids = jnp.asarray(np.random.default_rng(9).integers(0, config.vocab_size, (2, 20)), jnp.int32)

    def lens(hidden):
        return np.asarray(model.head(params, model.rms_norm(hidden, params.norm, config.rms_norm_eps)))

    logits, hidden = wise_jax.forward(params, config, ids, return_hidden=True)
    assert hidden.shape == (config.total_ut_steps, 2, 20, config.hidden_size) and hidden.dtype == jnp.float32
    np.testing.assert_array_equal(lens(hidden[-1]), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(wise_jax.forward(params, config, ids)))
    logits_x, exits, hidden_x = wise_jax.forward_with_exits(params, config, ids, return_hidden=True)
    np.testing.assert_array_equal(np.asarray(hidden_x), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(logits_x), np.asarray(logits))
    one_loop = np.asarray(FORWARD(params, dataclasses.replace(config, total_ut_steps=1), ids))
    diff, bound = rounding.model_difference(lens(hidden[0]), one_loop, config, keys=20)
    assert diff <= bound, (diff, bound)

    exiting = dataclasses.replace(config, early_exit_threshold=0.6)
    logits, hidden = wise_jax.forward(params, exiting, ids, return_hidden=True)
    lenses = np.stack([lens(h) for h in hidden])                          # [loops, batch, seq, vocab]
    lambdas = np.stack([np.asarray(model.exit_gate(params, model.rms_norm(h, params.norm, config.rms_norm_eps)))
                        for h in hidden])
    exit_loop = ouro_reference.exit_loops(lambdas, 0.6)
    assert len(np.unique(exit_loop)) >= 2
    chosen = np.take_along_axis(lenses, exit_loop[None, ..., None], 0)[0]
    np.testing.assert_array_equal(chosen, np.asarray(logits))


def test_gradients_through_positions_segments_and_hidden_are_finite(tiny):
    """A loss over the logits and the hidden states of a row packing a 258-token and a 6-token
    sequence (so the second's queries find no key of theirs in the first 256-key chunk of the
    chunked attention), at restarted positions: finite gradients that descend; with remat the same
    within float32 rounding of the two backward passes."""
    config, _, params = tiny
    config = dataclasses.replace(config, total_ut_steps=2)
    ids = jnp.asarray(np.random.default_rng(10).integers(0, config.vocab_size, (1, 265)), jnp.int32)
    segments = jnp.asarray([[0] * 258 + [1] * 7], jnp.int32)
    positions = model.segment_positions(segments)
    keep = (segments[:, 1:] == segments[:, :-1]).astype(jnp.float32)       # no target across segments

    def loss(params, remat):
        logits, hidden = wise_jax.forward(params, config, ids[:, :-1], positions=positions[:, :-1],
                                          segment_ids=segments[:, :-1], return_hidden=True, remat=remat)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
        return (nll * keep).sum() / keep.sum() + 1e-3 * jnp.mean(hidden[0] ** 2)

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    value, grads = value_and_grad(params, False)
    value_remat, grads_remat = value_and_grad(params, True)
    assert np.isfinite(float(value)) and float(value) == pytest.approx(float(value_remat), abs=1e-6)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_remat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)
    assert float(jnp.abs(grads.layers.qkv_proj).max()) > 0
    stepped = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    assert float(jax.jit(loss, static_argnums=1)(stepped, False)) < float(value)
