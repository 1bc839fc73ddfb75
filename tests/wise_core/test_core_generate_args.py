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


def test_token_ids_are_checked_once_for_every_caller():
    """wise_core.tokenizer.check_token_ids: what the engines, both generates and the JAX
    functional paths take as token ids."""
    import numpy as np

    from wise_core.tokenizer import check_token_ids
    assert check_token_ids(np.array([1, 2], np.int64), 8, "p") == [1, 2] and check_token_ids((7,), 8, "p") == [7]
    for ids, error, message in (
            ([1, True], TypeError, "p must be a string or a sequence of integer token ids"),
            ("ab", TypeError, "integer token ids"),
            (np.zeros((1, 2), np.int64), ValueError, r"p's token ids must be 1-D, got shape \(1, 2\)"),
            ([], ValueError, "p is empty"),
            ([3, 8, -1], ValueError, r"p holds token ids \[8, -1\] outside the vocabulary \(size 8\)")):
        with pytest.raises(error, match=message):
            check_token_ids(ids, 8, "p")


def test_generate_prompts_and_eos_policy_are_one():
    """wise_core.generation: prompts (strings through the tokenizer), lengths, and the eos
    policy both generates run: the model's eos stops as eos; another id replaces it; None never stops."""
    from wise_core.generation import check_positions, forced_pairs, generation_params, prompt_lists
    tok = byte_tokenizer()
    assert prompt_lists(["hi", [1, 2]], 258, tok, "prompts", "no") == [[104, 105], [1, 2]]
    for prompts, error, message in (("hi", TypeError, "non-empty list"), ([], ValueError, "non-empty list"),
                                    ([[1], [300]], ValueError, r"prompts\[1\] holds token ids \[300\]")):
        with pytest.raises(error, match=message):
            prompt_lists(prompts, 258, tok, "prompts", "no")
    with pytest.raises(ValueError, match=r"prompts\[0\] is a string: pass token ids"):
        prompt_lists(["hi"], 258, None, "prompts", "pass token ids")
    assert forced_pairs([1, 2], [3], 258, None, "no") == ([[1, 2]], [[3]])
    assert forced_pairs([[1], [2]], [[3], [4]], 258, None, "no") == ([[1], [2]], [[3], [4]])
    with pytest.raises(ValueError, match="2 contexts but 1 continuations"):
        forced_pairs([[1], [2]], [[3]], 258, None, "no")
    assert check_positions([[1, 2]], [3], 5, "prompts") == [5]
    with pytest.raises(ValueError, match=r"prompts\[0\]: 2 tokens \+ 4 more exceed max_position_embeddings \(5\)"):
        check_positions([[1, 2]], [4], 5, "prompts")
    kw = dict(max_new_tokens=3, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, stop=(), vocab_size=258, model_eos=256)
    for eos, ignore_eos, stops in ((MODEL_EOS, False, ()), (256, False, ()), (7, True, (7,)), (None, True, ())):
        p = generation_params(eos_token_id=eos, **kw)
        assert (p.ignore_eos, p.stop_token_ids, p.max_tokens) == (ignore_eos, stops, 3), eos
