"""wise_serve without a server: request validation (completions, chat, tokenize), incremental text and stop
strings, chat templates, metrics text."""

import json
import random

import pytest

from wise_core.tokenizer import byte_tokenizer
from wise_serve.metrics import Histogram
from wise_serve.protocol import BadRequest, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from wise_core.detokenize import TextStream


def parse(body, **kw):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_completion(raw, model_name="m", **kw)


def test_defaults_and_fields_reach_the_sampling_params():
    r = parse({"prompt": "hi"})
    p = r.generation.params(1, 100)
    assert (r.prompts, p.max_tokens, p.temperature, p.top_p, r.generation.stream) == (["hi"], 16, 1.0, 1.0, False)
    assert not p.logprobs and not r.echo
    r = parse({"model": "m", "prompt": [[3, 4]], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 7,
               "stop": "\n", "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
               "n": 1, "echo": True, "presence_penalty": 0.0, "user": "u"})
    g = r.generation
    assert r.prompts == [[3, 4]] and r.echo and g.stop == ("\n",) and g.stream and g.include_usage
    p = g.params(2, 100)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.ignore_eos) == (5, 0.0, 0.5, 7, True)
    assert (p.top_k, p.min_p) == (0, 0.0)
    p = parse({"prompt": "hi", "top_k": 40, "min_p": 0.05}).generation.params(1, 100)
    assert (p.top_k, p.min_p) == (40, 0.05) and parse({"prompt": "hi", "top_k": -1}).generation.params(1, 9).top_k == 0
    assert parse({"prompt": [1]}, has_tokenizer=False).generation.return_token_ids
    # echo with logprobs k scores the prompt (k too); either alone does not
    for body, want in (({"echo": True, "logprobs": 3}, 3), ({"echo": True, "logprobs": 0}, 0), ({"echo": True}, None),
                       ({"logprobs": 3}, None)):
        p = parse({"prompt": "hi", **body}).generation.params(1, 100)
        assert p.prompt_logprobs == want and p.logprobs == body.get("logprobs")
    assert parse({"prompt": "a", "logprobs": 0}).generation.params(1, 9).logprobs == 0   # logprobs=True is k = 0
    assert parse({"prompt": "a"}).generation.params(1, 9).logprobs is None


def test_n_penalties_logit_bias_and_top_logprobs_reach_the_sampling_params():
    r = parse({"prompt": "a", "n": 3, "best_of": 3, "presence_penalty": -2, "frequency_penalty": 1.5,
               "repetition_penalty": 1.2, "logit_bias": {"5": -100, "7": 2.5}, "min_tokens": 4,
               "include_stop_str_in_output": True, "logprobs": 5, "stop": "x"}, vocab_size=8)
    p = r.generation.params(1, 100)
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (3, -2.0, 1.5, 1.2)
    assert (p.logit_bias, p.min_tokens, p.include_stop_str_in_output, p.logprobs) == ({5: -100.0, 7: 2.5}, 4, True, 5)
    assert p.stop == ("x",)
    g = chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 20, "n": 2}).generation
    assert (g.logprobs, g.params(1, 100).n) == (20, 2)
    assert chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True}).generation.logprobs == 0
    assert chat({"messages": [{"role": "user", "content": "x"}], "logprobs": False}).generation.logprobs is None
    with pytest.raises(BadRequest, match=r"min_tokens \(5\) is more than max_tokens \(4\)") as e:
        parse({"prompt": "a", "min_tokens": 5, "max_tokens": 4}).generation.params(1, 100)
    assert e.value.param == "min_tokens"


def test_several_prompts_keep_their_order():
    assert parse({"prompt": ["a", "b", "c"]}).prompts == ["a", "b", "c"]
    assert parse({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]
    assert parse({"prompt": ["a", [3]]}).prompts == ["a", [3]]


def chat(body):
    return parse_chat(json.dumps(body).encode(), model_name="m")


def test_chat_fields():
    r = chat({"messages": [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                            "name": "x"}], "logprobs": True, "top_logprobs": 0, "max_completion_tokens": 7})
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb", "name": "x"}]
    assert r.generation.params(3, 100).max_tokens == 7 and r.generation.logprobs == 0
    assert chat({"messages": [{"role": "user", "content": "hi"}]}).generation.params(30, 100).max_tokens == 70
    with pytest.raises(BadRequest, match=r"the prompt holds 100 tokens: max_model_len \(100\) leaves no room"):
        chat({"messages": [{"role": "user", "content": "hi"}]}).generation.params(100, 100)


CHAT_BAD = [
    ({}, "messages", "messages is required"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": ["hi"]}, "messages", "messages[0] must be an object"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role must be one of"),
    ({"messages": [{"role": "user"}]}, "messages", "messages[0].content is required"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", "content must be a string or a non-empty list"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages",
     '"image_url" parts are not supported'),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "unknown field 'tool_calls'"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0}, "top_logprobs",
     "top_logprobs needs logprobs: true"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True}, "top_logprobs",
     "top_logprobs must be an integer in [0, 20]"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs", "logprobs must be true or false"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 3}, "max_tokens",
     "not both"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n", "n must be an integer in [1, 128], got 0"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools", "unknown field 'tools'"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt", "unknown field 'prompt'"),
]


@pytest.mark.parametrize("body, param, message", CHAT_BAD, ids=[m for _, _, m in CHAT_BAD])
def test_bad_chat_requests_name_the_problem(body, param, message):
    with pytest.raises(BadRequest) as e:
        chat(body)
    assert message in str(e.value) and e.value.param == param


TOKENIZE_BAD = [
    (parse_tokenize, {}, "prompt", "give either prompt (a text) or messages"),
    (parse_tokenize, {"prompt": "a", "messages": []}, "prompt", "not both or neither"),
    (parse_tokenize, {"prompt": [1]}, "prompt", "prompt must be a string"),
    (parse_tokenize, {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "messages only"),
    (parse_detokenize, {"tokens": "ab"}, "tokens", "tokens must be a list of integer token ids"),
    (parse_detokenize, {"tokens": [1, 300]}, "tokens", "ids [300] outside the vocabulary (size 258)"),
    (parse_detokenize, {"tokens": [1], "x": 1}, "x", "unknown field 'x'"),
]


@pytest.mark.parametrize("fn, body, param, message", TOKENIZE_BAD, ids=[m for *_, m in TOKENIZE_BAD])
def test_bad_tokenize_requests_name_the_problem(fn, body, param, message):
    kw = {"vocab_size": 258} if fn is parse_detokenize else {}
    with pytest.raises(BadRequest) as e:
        fn(json.dumps(body).encode(), model_name="m", **kw)
    assert message in str(e.value) and e.value.param == param


BAD = [
    (b"{not json", None, "invalid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    (b'{"prompt": "a", "max_tokens": NaN}', None, "NaN is not a JSON number"),
    (b'{"prompt": "a", "max_tokens": 3, "max_tokens": 9}', "max_tokens",
     "invalid JSON: the key 'max_tokens' appears twice in one object"),
    (b'{"prompt": "a", "logit_bias": {"5": 1, "5": -1}}', "5", "the key '5' appears twice in one object"),
    ({"prompt": "a", "logit_bias": {"1": 5, "01": -5}}, "logit_bias",
     "logit_bias keys '1' and '01' name the same token id 1"),
    ({"prompt": "a", "logit_bias": {"007": 5, "2": 1, "7": 1}}, "logit_bias",
     "logit_bias keys '007' and '7' name the same token id 7"),
    (b"\xff\xfe", None, "not UTF-8"),
    ({"prompt": "a", "max_tokns": 3}, "max_tokns", "unknown field 'max_tokns'"),
    ({"max_tokens": 3}, "prompt", "prompt is required"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", "max_tokens must be a positive integer, got 0"),
    ({"prompt": "a", "max_tokens": -3}, "max_tokens", "got -3"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens", "got 2.5"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens", "got true"),
    ({"prompt": "a", "max_tokens": "8"}, "max_tokens", 'got "8"'),
    ({"prompt": "a", "temperature": -0.1}, "temperature", "temperature must be a number >= 0"),
    ({"prompt": "a", "temperature": "hot"}, "temperature", "temperature must be a number"),
    ({"prompt": "a", "top_p": 0}, "top_p", "top_p must be a number in (0, 1], got 0"),
    ({"prompt": "a", "top_p": 1.5}, "top_p", "got 1.5"),
    ({"prompt": "a", "seed": -1}, "seed", "seed must be an integer in [0, 2**63)"),
    ({"prompt": "a", "top_k": -2}, "top_k", "top_k must be an integer >= -1 (-1 or 0: every token), got -2"),
    ({"prompt": "a", "top_k": 2.5}, "top_k", "got 2.5"),
    ({"prompt": "a", "min_p": 1.5}, "min_p", "min_p must be a number in [0, 1], got 1.5"),
    ({"prompt": "a", "model": "gpt-4"}, "model", "unknown model 'gpt-4': this server serves 'm'"),
    ({"prompt": 5}, "prompt", "prompt must be a string, a list of integer token ids, or a list of either, got int"),
    ({"prompt": [1, "x"]}, "prompt", "it holds 'x'"),
    ({"prompt": []}, "prompt", "prompt is empty"),
    ({"prompt": ["a", ""]}, "prompt", "prompt is empty"),
    ({"prompt": [[1], []]}, "prompt", "prompt is empty"),
    ({"prompt": [[1], [2, "x"]]}, "prompt", "it holds 'x'"),
    ({"prompt": "a", "stop": [""]}, "stop", "stop must be a non-empty string"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": "a", "stream": "yes"}, "stream", "stream must be true or false"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"prompt": "a", "stream": True, "stream_options": {"x": 1}}, "stream_options", "the one key include_usage"),
    ({"prompt": "a", "n": 129}, "n", "n must be an integer in [1, 128], got 129"),
    ({"prompt": "a", "n": True}, "n", "n must be an integer in [1, 128], got true"),
    ({"prompt": "a", "n": 2, "best_of": 3}, "best_of", "best_of=3 is not supported by this server (it returns every"),
    ({"prompt": "a", "best_of": 2}, "best_of", "best_of must equal n (1) or be left out"),
    ({"prompt": "a", "echo": 1}, "echo", "echo must be true or false"),
    ({"prompt": "a", "logprobs": 21}, "logprobs", "logprobs must be an integer in [0, 20]"),
    ({"prompt": "a", "logprobs": True}, "logprobs", "logprobs must be an integer in [0, 20]"),
    ({"prompt": "a", "logprobs": -1}, "logprobs", "logprobs must be an integer in [0, 20]"),
    ({"prompt": "a", "frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty must be a number in [-2, 2], "
                                                                     "got 2.5"),
    ({"prompt": "a", "presence_penalty": -3}, "presence_penalty", "presence_penalty must be a number in [-2, 2]"),
    ({"prompt": "a", "presence_penalty": "1"}, "presence_penalty", "presence_penalty must be a number"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be a number in (0, "
                                                                      "inf], got 0"),
    ({"prompt": "a", "logit_bias": {"1": 101}}, "logit_bias", "logit_bias['1'] must be a number in [-100, 100], "
                                                               "got 101"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"prompt": "a", "logit_bias": {"-1": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"prompt": "a", "logit_bias": [1]}, "logit_bias", "logit_bias must be an object"),
    ({"prompt": "a", "logit_bias": {"1": 1, "300": 1}}, "logit_bias", "logit_bias names token ids [300] outside the "
                                                                       "vocabulary (size 258)"),
    ({"prompt": "a", "min_tokens": -1}, "min_tokens", "min_tokens must be an integer >= 0, got -1"),
    ({"prompt": "a", "include_stop_str_in_output": 1}, "include_stop_str_in_output", "must be true or false"),
    ({"prompt": "a", "suffix": "x"}, "suffix", "the model does not fill in the middle"),
]


@pytest.mark.parametrize("body, param, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_requests_name_the_problem(body, param, message):
    with pytest.raises(BadRequest) as e:
        parse(body, vocab_size=258)
    assert message in str(e.value) and e.value.param == param


def test_a_model_without_tokenizer_takes_token_ids_only():
    with pytest.raises(BadRequest, match="no tokenizer: send the prompt as a list of token ids"):
        parse({"prompt": "text"}, has_tokenizer=False)
    with pytest.raises(BadRequest, match="stop strings need a tokenizer"):
        parse({"prompt": [1], "stop": "x"}, has_tokenizer=False)


def test_incremental_text_equals_the_full_decode_of_random_bytes():
    """Random bytes split UTF-8 characters across tokens and hold invalid sequences; every
    prefix handed out must be a prefix of the final text, which is decode(ids)."""
    tok = byte_tokenizer()
    rng = random.Random(0)
    alphabet = list("aé€😀 \n".encode()) + [0xFF, 0xC3, 0xE2, 0x80, 256]   # 256: eos, skipped by decode
    for _ in range(200):
        ids = [rng.choice(alphabet) if rng.random() < 0.7 else rng.randrange(258) for _ in range(rng.randint(1, 30))]
        stream, pieces = TextStream(tok), []
        for t in ids:
            stream.add([t])
            pieces.append(stream.delta(final=False))
            assert tok.decode(ids).startswith("".join(pieces))
        stream.finish()
        pieces.append(stream.delta(final=True))
        assert "".join(pieces) == tok.decode(ids)


@pytest.mark.parametrize("stop, text, want", [
    (("\n",), "def f():\n    pass", "def f():"),
    (("pass", "():"), "def f():\n    pass", "def f"),          # the earliest occurrence wins
    (("xyz",), "def f():", "def f():"),
    (("ss",), "pass", "pa"),
])
def test_stop_strings_cut_the_text_across_token_boundaries(stop, text, want):
    tok = byte_tokenizer()
    stream, pieces = TextStream(tok, stop), []
    for b in text.encode():
        stream.add([b])
        pieces.append(stream.delta(final=False))
        if stream.stopped:
            break
    else:
        stream.finish()
    pieces.append(stream.delta(final=True))
    assert "".join(pieces) == want and stream.stopped == (want != text)
    assert all(s not in "".join(pieces) for s in stop)


def test_a_stream_following_the_engine_never_hands_out_text_the_engine_cuts():
    """A follower (cut=False: what `wise serve` and `wise generate --stream` run) fed the tokens
    an engine-side stream (cut=True) consumed hands out, piece by piece until the engine's last
    token, a prefix of the engine's final text, and with finish(that text) exactly it: for random
    byte streams (split characters among them), stop strings, min_tokens and include_stop."""
    tok, rng = byte_tokenizer(), random.Random(1)
    alphabet = list("ab\né".encode())
    for _ in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 24))]
        stop = tuple({"".join(rng.choice("ab\n") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 2))})
        kw = dict(min_tokens=rng.randint(0, 4), include_stop=rng.random() < 0.5)
        engine, follower, pieces = TextStream(tok, stop, **kw), TextStream(tok, stop, cut=False), []
        for t in ids:
            engine.add([t])
            follower.add([t])
            if engine.stopped:          # the engine's output of this token is its last: finish(text) follows
                break
            pieces.append(follower.delta(final=False))
        engine.finish()
        assert engine.text.startswith("".join(pieces)), (ids, stop, kw)
        follower.finish(engine.text)
        pieces.append(follower.delta(final=True))
        assert "".join(pieces) == engine.text and not follower.stopped
    with pytest.raises(RuntimeError, match="does not begin with the text already handed out"):
        follower = TextStream(tok, cut=False)
        follower.add(list(b"abc"))
        follower.delta(final=False)
        follower.finish("xyz")


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    h = Histogram("wise_x_seconds", "x.", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    lines = h.render()
    assert 'wise_x_seconds_bucket{le="0.1"} 2' in lines and 'wise_x_seconds_bucket{le="1.0"} 3' in lines
    assert 'wise_x_seconds_bucket{le="+Inf"} 4' in lines and "wise_x_seconds_count 4" in lines
    assert "wise_x_seconds_sum 2.65" in lines
