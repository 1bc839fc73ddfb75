"""wise_torch.wise_state: slots, per-loop modes with provenance, fallbacks, density, snapshots;
and, through the model, that an interrupted discovery decodes exactly as dense."""

import dataclasses

import pytest
import torch

import wise_torch as wt
from wise_core.checkpoint import random_tensors
from wise_core.config import PRESETS, ConfigError, WiseConfig
from wise_core.modes import DENSE, DISCOVER, DISCOVER_UNION, SPARSE
from wise_torch.kv_cache import DecodeBatch
from wise_torch.wise_state import WiseSlotsExhausted, WiseState

CONFIG = PRESETS["test-tiny"]  # 2 layers, 2 heads, 4 loops
LAYERS = CONFIG.num_hidden_layers


def state(max_slots=2, max_blocks=4, **wise):
    return WiseState(WiseConfig(**wise), CONFIG, max_slots=max_slots, max_blocks=max_blocks)


def batch(requests, positions, slots):
    positions = torch.tensor(positions)
    return DecodeBatch(positions=positions, seq_lens=(positions + 1).int(),
                       page_table=torch.zeros(len(requests), 1, dtype=torch.int32),
                       slot_mapping=torch.zeros(len(requests), dtype=torch.int64),
                       request_ids=torch.tensor(requests), wise_slots=torch.tensor(slots))


def step_modes(ws, b, loops=range(4)):
    return {loop: ws.begin_loop(loop, b).tolist() for loop in loops}


def test_slots():
    ws = state(max_slots=2)
    assert ws.acquire(5) == 0 and ws.acquire(6) == 1
    with pytest.raises(WiseSlotsExhausted, match="all 2 WISE slots are in use"):
        ws.acquire(7)
    ws.release(1)
    assert ws.acquire(7) == 1
    with pytest.raises(ValueError, match="request 5 already holds a WISE slot"):
        ws.acquire(5)
    ws.release(0)
    with pytest.raises(ValueError, match="WISE slot 0 is not held"):
        ws.release(0)
    with pytest.raises(ValueError, match="non-negative"):
        ws.acquire(-1)
    with pytest.raises(ConfigError, match="out of range for a model with 4 loops"):
        state(reuse_depths=(2, 4))


def test_a_full_step_discovers_then_reuses():
    ws = state()
    b = batch([3, 4], [40, 70], [ws.acquire(3), ws.acquire(4)])
    modes = step_modes(ws, b)
    assert modes[0] == [[DISCOVER] * 2] * LAYERS
    assert modes[1] == [[DISCOVER_UNION] * 2] * LAYERS
    assert modes[2] == modes[3] == [[SPARSE] * 2] * LAYERS
    assert ws.fallbacks == 0
    # The next position: a reuse depth before its discovery must not read the old support.
    nxt = batch([3, 4], [41, 71], [0, 1])
    assert ws.begin_loop(2, nxt).tolist() == [[DENSE] * 2] * LAYERS
    assert ws.fallbacks == 2 * LAYERS
    assert step_modes(ws, nxt, [0, 1, 2])[2] == [[SPARSE] * 2] * LAYERS


def test_dense_loops_when_no_role():
    ws = state(discover_depths=(0,), reuse_depths=(3,))
    b = batch([0], [5], [ws.acquire(0)])
    modes = step_modes(ws, b)
    assert modes[0] == [[DISCOVER]] * LAYERS and modes[1] == modes[2] == [[DENSE]] * LAYERS
    assert modes[3] == [[SPARSE]] * LAYERS


def test_released_and_reacquired_slot_falls_back():
    ws = state()
    slot = ws.acquire(3)
    b = batch([3], [40], [slot])
    ws.begin_loop(0, b)
    ws.release(slot)
    assert ws.acquire(3) == slot  # same request, same slot: the window is still broken
    modes = step_modes(ws, b, [1, 2, 3])
    assert modes[1] == [[DISCOVER]] * LAYERS  # fresh, not a union with the old support
    assert modes[2] == modes[3] == [[DENSE]] * LAYERS
    assert ws.fallbacks == 2 * LAYERS


def test_foreign_support_is_never_reused():
    ws = state(max_slots=1)
    slot = ws.acquire(1)
    step_modes(ws, batch([1], [40], [slot]), [0, 1])
    ws.release(slot)
    other = batch([2], [40], [ws.acquire(2)])  # same slot and position, another request
    assert ws.begin_loop(2, other).tolist() == [[DENSE]] * LAYERS
    assert ws.fallbacks == LAYERS


def test_skipped_discovery_depth_falls_back_per_row():
    ws = state()
    b = batch([0, 1], [10, 20], [ws.acquire(0), ws.acquire(1)])
    ws.begin_loop(0, b)
    ws.begin_loop(1, batch([1], [20], [1]))  # only row 1 runs depth 1
    assert ws.begin_loop(2, b).tolist() == [[DENSE, SPARSE]] * LAYERS
    assert ws.fallbacks == LAYERS


def test_density_counts_selected_causal_blocks_and_resets():
    ws = state(max_slots=1, max_blocks=4)
    b = batch([0], [70], [ws.acquire(0)])  # 71 keys: 3 causal blocks
    step_modes(ws, b, [0, 1])
    ws.support[0, 0, :, :] = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)  # 1 and 3 causal
    ws.support[0, 1, :, :] = torch.tensor([[0, 1, 0, 0], [0, 0, 1, 0]], dtype=torch.bool)  # 1 and 1
    ws.begin_loop(2, b)
    assert ws.density() == {2: pytest.approx(6 / 12), 3: None}
    ws.release(0)
    ws.acquire(0)
    ws.begin_loop(3, b)  # fallback rows attend every causal block
    assert ws.density() == {2: pytest.approx(6 / 12), 3: 1.0}
    ws.reset_counters()
    assert ws.density() == {2: None, 3: None} and ws.fallbacks == 0


def test_store_with_all_blocks_selects_every_causal_block():
    ws = state(max_slots=1, max_blocks=4, all_blocks=True)
    b = batch([0], [40], [ws.acquire(0)])
    ws.store(1, b, torch.zeros(1, 2, 4, dtype=torch.bool))
    assert ws.support[0, 1].tolist() == [[True, True, False, False]] * 2
    assert not ws.support[0, 0].any()


def test_snapshot_restore():
    ws = state()
    b = batch([0], [40], [ws.acquire(0)])
    step_modes(ws, b, [0, 1])
    ws.support[0, 0, 0, 1] = True
    saved = ws.snapshot()
    step_modes(ws, batch([0], [41], [0]), [2, 0])
    ws.support.fill_(False)
    ws.release(0)
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
    prompt = torch.randint(0, config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(0))
    cache = wt.PagedKVCache.for_model(config, num_pages=4, page_size=32)
    cache.reserve(0, 81)
    with torch.inference_mode():
        model.prefill(prompt, torch.tensor([80]), cache, cache.page_table([0], 3))
    return model, cache


def run(model, cache, loops, wise=None, interrupt=None):
    b = cache.decode_batch([0], [81], 3, wise_slots=None if wise is None else [wise.acquire(0)])
    with torch.inference_mode():
        ctx = model.decode_context(b, cache, wise=wise, kernel="reference")
        h = model.model.embed_tokens(torch.tensor([5]))
        for loop in loops:
            h = model.run_loop(h, loop, ctx)
            if interrupt is not None and loop == 0:
                interrupt(wise, b)
        return model.logits(h)


def reacquire(wise, b):
    wise.release(int(b.wise_slots[0]))
    b.wise_slots[0] = wise.acquire(0)


def test_interrupted_discovery_decodes_exactly_dense(prefilled):
    model, cache = prefilled
    config = model.config
    wise_config = WiseConfig(eta=0.5, kernel="reference")
    dense = run(model, cache, range(4))
    whole = WiseState(wise_config, config, max_slots=1, max_blocks=3)
    sparse = run(model, cache, range(4), wise=whole)
    assert whole.fallbacks == 0 and whole.density()[2] < 1.0
    assert not torch.equal(sparse, dense)  # real sparsity changes the logits ...
    for loops, interrupt in ((range(4), reacquire), ((0, 2, 3), None)):
        wise = WiseState(wise_config, config, max_slots=1, max_blocks=3)
        got = run(model, cache, loops, wise=wise, interrupt=interrupt)
        assert torch.equal(got, run(model, cache, loops))  # ... an interrupted window does not
        assert wise.fallbacks == 2 * config.num_hidden_layers
        assert wise.density() == {2: 1.0, 3: 1.0}
