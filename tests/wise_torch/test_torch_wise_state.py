"""wise_torch.wise_state: per-loop modes, token tags written only once supports are stored and
that tell tokens apart, fallbacks, density, snapshots; and, through the model, that an
interrupted discovery decodes exactly as dense."""

import dataclasses

import pytest
import torch

import wise_torch as wt
from wise_core.checkpoint import random_tensors
from wise_core.config_error import ConfigError
from wise_core.modes import DENSE, DISCOVER, DISCOVER_UNION, SPARSE
from wise_core.presets import PRESETS
from wise_core.wise_config import WiseConfig
from wise_torch.attention import decode_attention_reference
from wise_torch.kv_cache import DecodeBatch, PrefillBatch, PrefillGroup
from wise_torch.model import DecodeContext
from wise_torch.wise_state import WiseState

CONFIG = PRESETS["test-tiny"]  # 2 layers, 2 heads, 4 loops
LAYERS = CONFIG.num_hidden_layers


def state(max_rows=2, max_blocks=4, **wise):
    return WiseState(WiseConfig(**wise), CONFIG, max_rows=max_rows, max_blocks=max_blocks)


def batch(tags, positions):
    positions = torch.tensor(positions)
    return DecodeBatch(positions=positions, seq_lens=(positions + 1).int(),
                       page_table=torch.zeros(len(tags), 1, dtype=torch.int32),
                       slot_mapping=torch.zeros(len(tags), dtype=torch.int64), tags=torch.tensor(tags))


def run_loops(ws, b, loops=range(4)):
    """Modes of each loop (None for a dense loop), ending each loop as the model does."""
    modes = {}
    for loop in loops:
        m = ws.begin_loop(loop, b)
        modes[loop] = None if m is None else m.tolist()
        ws.end_loop(loop, b)
    return modes


def test_a_full_step_discovers_then_reuses():
    ws = state()
    b = batch([3, 4], [40, 70])
    modes = run_loops(ws, b)
    assert modes[0] == [[DISCOVER] * 2] * LAYERS
    assert modes[1] == [[DISCOVER_UNION] * 2] * LAYERS
    assert modes[2] == modes[3] == [[SPARSE] * 2] * LAYERS
    assert ws.fallbacks == 0
    # The next token: a reuse depth before its discovery must not read the old support.
    nxt = batch([5, 6], [41, 71])
    assert ws.begin_loop(2, nxt).tolist() == [[DENSE] * 2] * LAYERS
    assert ws.fallbacks == 2 * LAYERS
    assert run_loops(ws, nxt, [0, 1, 2])[2] == [[SPARSE] * 2] * LAYERS
    with pytest.raises(ConfigError, match="out of range for a model with 4 loops"):
        state(reuse_depths=(2, 4))


def test_tags_are_written_when_supports_are_stored_not_before():
    ws = state()
    b = batch([3, 4], [40, 70])
    ws.begin_loop(0, b)              # the discovery loop starts ... and is cut short before its end
    ws.begin_loop(1, b)
    assert ws.begin_loop(1, b).tolist() == [[DISCOVER] * 2] * LAYERS   # not a union with nothing stored
    assert ws.begin_loop(2, b).tolist() == [[DENSE] * 2] * LAYERS
    assert ws.fallbacks == 2 * LAYERS


def test_same_position_another_token_never_reuses():
    ws = state(max_rows=1)
    run_loops(ws, batch([1], [40]), [0, 1])
    # The same row and position, another token (a rejected draft, a restarted request): a new tag.
    other = batch([2], [40])
    assert ws.begin_loop(2, other).tolist() == [[DENSE]] * LAYERS
    assert ws.begin_loop(1, other).tolist() == [[DISCOVER]] * LAYERS
    assert ws.fallbacks == LAYERS


def test_dense_loops_when_no_role():
    ws = state(discover_depths=(0,), reuse_depths=(3,))
    modes = run_loops(ws, batch([0], [5]))
    assert modes[0] == [[DISCOVER]] * LAYERS and modes[1] is None and modes[2] is None
    assert modes[3] == [[SPARSE]] * LAYERS


def test_skipped_discovery_depth_falls_back_per_row():
    ws = state()
    run_loops(ws, batch([0, 1], [10, 20]), [0])
    b = batch([9, 1], [10, 20])      # row 0 now decodes another token: its depth 0 did not run for it
    assert run_loops(ws, b, [1])[1] == [[DISCOVER, DISCOVER_UNION]] * LAYERS
    assert ws.begin_loop(2, b).tolist() == [[DENSE, SPARSE]] * LAYERS
    assert ws.fallbacks == LAYERS


def test_padding_rows_are_never_counted():
    ws = state()
    b = batch([7, -1], [40, 0])      # row 1 pads the step to its bucket
    run_loops(ws, b, [2])
    assert ws.fallbacks == LAYERS    # only the real row fell back
    assert ws.density()[2] == 1.0


def test_sparse_draft_reads_its_verified_tokens_support_only():
    """A sparse draft step (SpeculativeConfig(sparse_discovery=True)): every loop, discovery
    loops included, is SPARSE on the support tagged with the row's verified token, plus the
    blocks of the keys after that token; a support of any other token (a stale one of the same
    row, a foreign one) or an incomplete one gives DENSE, counted as a fallback at the reuse
    depths; no tag changes."""
    ws = state(max_rows=3, max_blocks=8)                 # block_size 32
    run_loops(ws, batch([10, 11, 12], [40, 95, 60]), [0, 1])         # the verified tokens' discovery
    ws.support[:, :, :, :] = False
    ws.support[:, :, :, 0] = True                        # every support: block 0 alone
    tags, supports = ws.tag.clone(), ws.support.clone()
    ws.depths_run[2, 1] = 1                              # row 2, layer 1: depth 1 did not run
    draft = batch([20, 21, 22], [42, 97, 62])            # each row's second draft token
    verified = torch.tensor([10, 9, 12]), torch.tensor([40, 95, 60])   # row 1 names a stale token
    for loop in range(4):
        modes = ws.sparse_draft_modes(loop, draft, *verified).tolist()
        assert modes == [[SPARSE, DENSE, SPARSE], [SPARSE, DENSE, DENSE]], loop
    assert torch.equal(ws.tag, tags)
    assert ws.fallbacks == 2 * (LAYERS + 1)              # row 1 at both layers, row 2 at layer 1; loops 2 and 3
    # Row 0: keys 41-42 after its verified token lie in block 1; row 1 (no support of its
    # token) unchanged; row 2: keys 61-62 in block 1 (layer 0 sparse; layer 1 falls back anyway).
    added = supports.clone()
    added[:, 0, :, 1] = True
    added[:, 2, :, 1] = True
    assert torch.equal(ws.support, added)
    # A draft in a new block: the blocks from the key after the verified token's to its own;
    # the verified token's block (its discovery saw it) is left as found.
    ws.support[:, 0] = False
    ws.support[:, 0, :, 0] = True
    ws.sparse_draft_modes(0, batch([23, -1, -1], [97, 0, 0]), torch.tensor([10, -1, -1]), torch.tensor([63, 0, 0]))
    assert ws.support[:, 0].tolist() == [[[True, False, True, True, False, False, False, False]] * 2] * LAYERS


def test_density_counts_selected_causal_blocks_and_resets():
    ws = state(max_rows=1, max_blocks=4)
    b = batch([0], [70])             # 71 keys: 3 causal blocks
    run_loops(ws, b, [0, 1])
    ws.support[0, 0] = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)  # 1 and 3 causal
    ws.support[1, 0] = torch.tensor([[0, 1, 0, 0], [0, 0, 1, 0]], dtype=torch.bool)  # 1 and 1
    ws.begin_loop(2, b)
    assert ws.density() == {2: pytest.approx(6 / 12), 3: None}
    ws.begin_loop(3, batch([9], [70]))  # a fallback row attends every causal block
    assert ws.density() == {2: pytest.approx(6 / 12), 3: 1.0}
    ws.reset_counters()
    assert ws.density() == {2: None, 3: None} and ws.fallbacks == 0


def test_all_blocks_selects_every_causal_block_at_the_end_of_discovery():
    ws = state(max_rows=1, max_blocks=4, all_blocks=True)
    b = batch([0], [40])
    ws.begin_loop(0, b)
    ws.support_of(1, 1)[:] = False   # whatever the kernel selected
    ws.end_loop(0, b)
    assert ws.support[1, 0].tolist() == [[True, True, False, False]] * 2


def test_snapshot_restore():
    ws = state()
    b = batch([0], [40])
    run_loops(ws, b, [0, 1])
    ws.support[0, 0, 0, 1] = True
    saved = ws.snapshot()
    run_loops(ws, batch([1], [41]), [2, 0])
    ws.support.fill_(False)
    support = ws.support
    ws.restore(saved)
    assert ws.support is support  # restored in place
    for name, tensor in saved.items():
        assert torch.equal(getattr(ws, name), tensor), name
    assert ws.begin_loop(2, b).tolist() == [[SPARSE]] * LAYERS and ws.fallbacks == 0
    with pytest.raises(ValueError, match="snapshot tensor 'support'"):
        ws.restore({**saved, "support": saved["support"][:1]})


# -- through the model: interrupted discovery decodes exactly as dense ----------------------------
@pytest.fixture(scope="module")
def prefilled():
    config = dataclasses.replace(CONFIG, num_hidden_layers=1)
    model = wt.from_tensors(config, random_tensors(config, seed=0, std=0.08))
    prompt = torch.randint(0, config.vocab_size, (80,), generator=torch.Generator().manual_seed(0))
    cache = wt.PagedKVCache.for_model(config, num_pages=4, page_size=32)
    pages = torch.tensor([[2, 0, 3]])
    slots = (pages[0, torch.arange(80) // 32] * 32 + torch.arange(80) % 32)
    with torch.inference_mode():
        model.prefill(prompt, PrefillBatch(torch.arange(80), slots, [PrefillGroup(0, 80, 1, torch.arange(80), pages)],
                                           torch.tensor([79])), cache)
    return model, cache


class Interrupted(DecodeContext):
    """A step whose rows change tokens after loop 0 (as if the step had been cut short)."""

    def end_loop(self, loop):
        super().end_loop(loop)
        if loop == 0:
            self.batch.tags += 100


def run(model, cache, wise=None, context=DecodeContext):
    b = DecodeBatch(positions=torch.tensor([80]), seq_lens=torch.tensor([81], dtype=torch.int32),
                    page_table=torch.tensor([[2, 0, 3]], dtype=torch.int32),
                    slot_mapping=torch.tensor([3 * 32 + 16]), tags=torch.tensor([5]))
    heads = model.config.num_attention_heads
    ctx = context(model.config, b, cache, wise, decode_attention_reference, torch.zeros(1, dtype=torch.int32),
                  torch.zeros(1, heads, 3, dtype=torch.bool))
    with torch.inference_mode():
        return model.logits(model.run_tokens(torch.tensor([5]), ctx))


def test_interrupted_discovery_decodes_exactly_dense(prefilled):
    model, cache = prefilled
    config = model.config
    wise_config = WiseConfig(eta=0.5)
    dense = run(model, cache)
    whole = WiseState(wise_config, config, max_rows=1, max_blocks=3)
    sparse = run(model, cache, wise=whole)
    assert whole.fallbacks == 0 and whole.density()[2] < 1.0
    assert not torch.equal(sparse, dense)  # real sparsity changes the logits ...
    wise = WiseState(wise_config, config, max_rows=1, max_blocks=3)
    got = run(model, cache, wise=wise, context=Interrupted)
    assert torch.equal(got, dense)         # ... an interrupted window does not
    assert wise.fallbacks == 2 * config.num_hidden_layers
    assert wise.density() == {2: 1.0, 3: 1.0}
