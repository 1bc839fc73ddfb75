"""Sizes and depths an engine cannot honour are refused before anything is allocated, with an
error naming them (wise_core.engine.args), in both engines: a pool larger than the memory left
for it says the bytes it would need (never a killed process or a raw allocator error), page ids
past int32, a Huginn engine of no core iteration or of absurdly many, an AdaptiveDepth whose
min_steps leaves no iteration to exit after."""

import re

import pytest

from engine_cases import FRAMEWORKS, Framework, drained
from wise_core.adaptive_depth import AdaptiveDepth
from wise_core.engine.args import MAX_PAGES, check_pool_fits
from wise_core.presets import PRESETS
from wise_core.sampling_params import SamplingParams

OURO, HUGINN = PRESETS["test-tiny"], PRESETS["test-tiny-huginn"]
POOL_TOO_LARGE = r"num_pages=\d+ pages of \d+ bytes \(K and V of every plane\) need [\d.]+ GiB, more than the "


@pytest.fixture(scope="module", params=FRAMEWORKS)
def ouro(request):
    return Framework(request.param, OURO, seed=0)


@pytest.fixture(scope="module", params=FRAMEWORKS)
def huginn(request):
    return Framework(request.param, HUGINN, seed=0)


def small(**kw) -> dict:
    return {"num_pages": 8, "page_size": 32, "max_num_seqs": 2, "max_model_len": 128,
            "attention_backend": "reference", **kw}


def test_a_pool_larger_than_memory_names_the_bytes_it_needs(ouro):
    """10**6 pages of this model's 256 KiB are 244 GiB: refused before any page exists; the
    engine of a pool that fits runs."""
    with pytest.raises(ValueError, match=POOL_TOO_LARGE + r".*pass a smaller num_pages") as e:
        ouro.engine(**small(num_pages=10 ** 6, max_model_len=None))
    assert "num_pages=1000000 pages of 262144 bytes" in str(e.value) and "244.14 GiB" in str(e.value)
    llm = ouro.engine(**small())
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids) == 3
    drained(llm)


def test_page_ids_past_int32_are_refused_at_once(ouro):
    for pages in (MAX_PAGES + 1, 2 ** 40):
        with pytest.raises(ValueError, match=rf"num_pages must be at most {MAX_PAGES} \(page ids are int32 on the "
                                             rf"device\), got {pages}"):
            ouro.engine(**small(num_pages=pages))


def test_the_pool_check_compares_the_bytes_with_the_memory_given():
    check_pool_fits(4, 1 << 20, 4 << 20, "free")           # exactly fits
    check_pool_fits(10 ** 9, 1 << 20, None, "unknown")      # memory not known: not checked
    with pytest.raises(ValueError, match=re.escape("num_pages=5 pages of 1048576 bytes (K and V of every plane) "
                                                   "need 0.00 GiB, more than the 0.00 GiB free on cuda:0")):
        check_pool_fits(5, 1 << 20, 4 << 20, "free on cuda:0")


def test_a_huginn_engine_of_no_core_iteration_is_refused(huginn):
    """num_steps=0 ran the coda on the random initial state."""
    with pytest.raises(ValueError, match=r"num_steps=0 core iterations: an engine runs at least one core iteration "
                                         r"per token \(num_steps must be >= 1\)"):
        huginn.engine(**small(num_steps=0))


def test_absurdly_many_core_iterations_name_the_bytes_they_need(huginn):
    """num_steps=10**6 makes each page 3 * 10**6 planes deep: the pool's bytes are named, not a raw
    allocator error."""
    with pytest.raises(ValueError, match=POOL_TOO_LARGE):
        huginn.engine(**small(num_steps=10 ** 6))


@pytest.mark.parametrize("min_steps, num_steps", [(2, 3), (3, 3), (40, 32)])
def test_adaptive_depth_whose_min_steps_leaves_no_exit_is_refused(min_steps, num_steps):
    """Exits are checked after iterations min_steps .. num_steps - 2: with none left the request
    never exits, so the engine refuses it (torch: its engine checks; wise_jax.LLM's is the
    lead's change, see docs/DESIGN.md)."""
    fw = Framework("torch", HUGINN, seed=0)
    with pytest.raises(ValueError, match=rf"AdaptiveDepth.min_steps={min_steps} leaves no core iteration to exit "
                                         rf"after with num_steps={num_steps} .* min_steps must be at most "
                                         rf"{num_steps - 2}"):
        fw.engine(**small(num_steps=num_steps, adaptive_depth=AdaptiveDepth(min_steps=min_steps)))
    llm = fw.engine(**small(num_steps=num_steps, adaptive_depth=AdaptiveDepth(min_steps=num_steps - 2)))
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids) == 2
