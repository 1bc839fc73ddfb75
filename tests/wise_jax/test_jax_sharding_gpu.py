"""wise_jax over a 2-GPU mesh (the Pallas kernel inside shard_map), against one GPU: the built-in
model in bf16, dense and WISE. Skipped without two GPUs visible to JAX.

parity.checks.compare_runs: logits within `rounding.model_bound` (bf16) and the same greedy
tokens except where the runs part on a near tie (top-2 gap within twice the bound); each psum
adds the devices' partial sums rounded to bf16, one more rounding per sublayer than one GPU."""

import sysconfig
from pathlib import Path

import jax
import pytest

import wise_jax
from parity.checks import compare_runs
from parity.suite import Generated
from wise_core.wise_config import WiseConfig


def _gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs for jax")]


def stdlib_prompts(tokenizer, count, length):
    """`count` prompts of `length` tokens: the starts of the stdlib's larger .py files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    ids = [tokenizer.encode(p.read_text(errors="replace")).ids[:length] for p in sorted(root.glob("*.py"))]
    return [x for x in ids if len(x) == length][:count]


@pytest.mark.parametrize("mode", ["dense", "wise"])
def test_bf16_two_gpus_equal_one_up_to_near_ties(mode):
    config, params, tokenizer = wise_jax.load_model("ouro-py-3m", dtype="bfloat16", with_tokenizer=True)
    prompts = stdlib_prompts(tokenizer, 32, 256)
    assert len(prompts) == 32
    args = dict(max_new_tokens=64, eos_token_id=None, return_logits=True,
                wise_config=WiseConfig() if mode == "wise" else None, attention_backend="pallas")
    one = wise_jax.generate(params, config, prompts, **args)
    two = wise_jax.generate(params, config, prompts, mesh=wise_jax.make_mesh(2), **args)
    result = compare_runs(config, Generated(one.tokens, one.logits), Generated(two.tokens, two.logits),
                          "bfloat16", False)
    print(f"\njax {mode} bf16 ouro-py-3m, 32 prompts x 64 tokens, 1 vs 2 GPUs: {result.detail} "
          f"(max |logit diff| {result.measured:.3g}, bound {result.bound:.3g})")
    assert result.passed, result.detail
    if mode == "wise":
        assert one.stats.fallbacks == two.stats.fallbacks == 0
        assert abs(one.stats.density[2] - two.stats.density[2]) < 0.02 and two.stats.density[2] < 1
