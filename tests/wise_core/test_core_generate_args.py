"""wise_core.generate_args and wise_core.tokenizer.encode_text: bad generate arguments are
errors naming the argument (no comparison of a str with 0, no overflow deep in a library)."""

import pytest

from wise_core.config_error import ConfigError
from wise_core.generate_args import (MODEL_EOS, check_max_new_tokens, check_sampling, check_seed,
                                     check_wise_config, resolve_eos)
from wise_core.tokenizer import byte_tokenizer, encode_text
from wise_core.wise_config import WiseConfig


@pytest.mark.parametrize("temperature, top_p, error, message", [
    ("0.5", 1.0, TypeError, "temperature must be a number, got '0.5'"),
    (True, 1.0, TypeError, "temperature must be a number, got True"),
    (float("nan"), 1.0, ValueError, "temperature must be finite and >= 0"),
    (float("inf"), 1.0, ValueError, "temperature must be finite and >= 0"),
    (-0.1, 1.0, ValueError, "temperature must be finite and >= 0"),
    (0.5, "1", TypeError, "top_p must be a number, got '1'"),
    (0.5, 0.0, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    (0.5, float("nan"), ValueError, r"top_p must be in \(0, 1\], got nan"),
])
def test_sampling_errors(temperature, top_p, error, message):
    with pytest.raises(error, match=message):
        check_sampling(temperature, top_p)


def test_valid_arguments_pass_through():
    assert check_sampling(0, 1) == (0.0, 1.0) and check_sampling(1e-30, 0.5) == (1e-30, 0.5)
    assert check_seed(None) is None and check_seed(2 ** 63 - 1) == 2 ** 63 - 1
    assert check_max_new_tokens(3) == 3
    assert resolve_eos(MODEL_EOS, 10, 7) == 7 and resolve_eos(None, 10, 7) is None and resolve_eos(0, 10, 7) == 0
    wise = WiseConfig()
    assert check_wise_config(wise, 4) is wise and check_wise_config(None, 4) is None


@pytest.mark.parametrize("call, error, message", [
    (lambda: check_seed(2 ** 70), ValueError, r"seed must be in \[0, 2\*\*63\), got 1180591620717411303424"),
    (lambda: check_seed(-1), ValueError, r"seed must be in \[0, 2\*\*63\)"),
    (lambda: check_seed(1.0), TypeError, "seed must be an int or None, got 1.0"),
    (lambda: check_max_new_tokens("3"), TypeError, "max_new_tokens must be an int, got '3'"),
    (lambda: check_max_new_tokens(0), ValueError, "max_new_tokens must be >= 1, got 0"),
    (lambda: resolve_eos("x", 10, 7), TypeError, "eos_token_id must be an int token id or None, got 'x'"),
    (lambda: resolve_eos(10, 10, 7), ValueError, r"eos_token_id 10 is outside the vocabulary \(size 10\)"),
    (lambda: resolve_eos(True, 10, 7), TypeError, "eos_token_id must be an int token id or None, got True"),
    (lambda: check_wise_config({"eta": 0.9}, 4), TypeError,
     r"wise_config must be a WiseConfig or None, got dict \{'eta': 0.9\} \(build one: WiseConfig\(\*\*settings\)\)"),
    (lambda: check_wise_config(WiseConfig(reuse_depths=(2, 5)), 4), ConfigError, r"\[5\] are out of range"),
])
def test_argument_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_encode_text_rejects_a_lone_surrogate():
    tokenizer = byte_tokenizer()
    assert encode_text(tokenizer, "hi") == [104, 105]
    with pytest.raises(ValueError, match=r"prompts\[1\] holds a lone surrogate '\\udcff' at index 2"):
        encode_text(tokenizer, "ab\udcffc", "prompts[1]")
    with pytest.raises(TypeError, match="prompt must be a str, got bytes"):
        encode_text(tokenizer, b"hi")


def test_generate_prompts_and_params_are_paired_or_refused():
    """LLM.generate's arguments (wise_core.sampling_params.prompts_with_params, both engines)."""
    import numpy as np
    from wise_core.sampling_params import SamplingParams, prompts_with_params
    a, b = SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)
    assert prompts_with_params(["x", [1, 2]], a) == [("x", a), ([1, 2], a)]
    assert prompts_with_params(("x", "y"), [a, b]) == [("x", a), ("y", b)]
    assert prompts_with_params(["x"], None) == [("x", None)]
    # One prompt, as vLLM takes it: a string, or a list of token ids.
    assert prompts_with_params("text", a) == [("text", a)]
    assert prompts_with_params([1, 2, 3], a) == [([1, 2, 3], a)]
    for bad in (np.arange(3), [], None, 7):
        with pytest.raises(TypeError, match="a string, a token-id list, or a non-empty list of them"):
            prompts_with_params(bad, a)

    class Array:  # an engine's own array type is refused as a bare prompt too
        pass
    with pytest.raises(TypeError, match="non-empty list"):
        prompts_with_params(Array(), a, (Array,))
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        prompts_with_params(["x", "y"], [a])
