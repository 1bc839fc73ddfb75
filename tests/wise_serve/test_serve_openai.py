"""The official `openai` client against `wise serve` (a subprocess, CPU) on a checkpoint with a chat
template, once per backend (`--backend torch`, `--backend jax`): completions and chat, n,
penalties, logit_bias and top logprobs.

The checkpoint is the packaged ouro-py-3m written again with a tokenizer_config.json holding a
chat template. Every text and logprob is compared with `LLM.generate` on the same prompt ids
with an engine of the same backend and settings (greedy), one request at a time.
"""

import json
import re

import pytest

# A test extra (pyproject's `test`), so CI has it; a GPU machine running `pytest -m gpu` may not.
openai = pytest.importorskip("openai")

from serve_cases import BACKENDS, Server, offline_engine
from wise_core.checkpoint import load_checkpoint, save_checkpoint
from wise_core.sampling_params import SamplingParams

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
            "# {{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}# assistant\n{% endif %}")
ENGINE = dict(num_pages=12, page_size=32, max_model_len=96, max_num_seqs=8)
# Logprobs: the same fp32 model on the same CPU, one request at a time in both engines; a
# row's float32 reductions may still be ordered differently by batch shape, ~1e-6 relative.
LOGPROB_ATOL = 1e-5


def render(messages):
    """TEMPLATE by hand: what the server must feed the engine."""
    return "<|endoftext|>" + "".join(f"# {m['role']}\n{m['content']}\n" for m in messages) + "# assistant\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = save_checkpoint(tmp_path_factory.mktemp("chat") / "ouro-chat", load_checkpoint("ouro-py-3m"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<|endoftext|>",
                                                            "eos_token": {"content": "<|endoftext|>"}}))
    return path


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def server(checkpoint, backend, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), "--model", str(checkpoint), "--served-model-name", "chatty",
               *(x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))), backend=backend)
    yield s
    assert s.stop() == 0, s.log_path.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(checkpoint, backend):
    return offline_engine(backend, str(checkpoint), **ENGINE)


def offline(llm, prompt, max_tokens):
    """-> the engine's RequestOutput for one prompt (text or ids), greedy, with logprobs."""
    ids = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt).ids
    [out] = llm.generate([ids], SamplingParams(max_tokens=max_tokens, logprobs=True), use_tqdm=False)
    return out


def test_completion_with_logprobs_equals_the_engine(client, llm):
    want = offline(llm, "def fib(n):", 12)
    r = client.completions.create(model="chatty", prompt="def fib(n):", max_tokens=12, temperature=0, logprobs=0)
    [c] = r.choices
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and c.index == 0
    assert c.text == want.text and c.finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    lp = c.logprobs
    assert lp.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ATOL)
    assert [list(d) for d in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_several_prompts_one_choice_each_in_order(client, llm):
    prompts = ["import os\n", "class Stack:", "x = ["]
    r = client.completions.create(model="chatty", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    wants = [offline(llm, p, 6) for p in prompts]
    assert [c.text for c in r.choices] == [w.text for w in wants]
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in wants)
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in wants)
    ids = [[100, 101, 102], [35, 32]]
    r = client.completions.create(model="chatty", prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in r.choices] == [offline(llm, p, 4).text for p in ids]


def test_several_prompts_stream_interleaved_with_their_index(client, llm):
    prompts = ["def add(a, b):", "for i in"]
    stream = client.completions.create(model="chatty", prompt=prompts, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
        for c in chunk.choices:
            assert reasons[c.index] is None                    # nothing after a choice's last chunk
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason
    wants = [offline(llm, p, 8) for p in prompts]
    assert texts == [w.text for w in wants] and reasons == [w.finish_reason for w in wants]
    assert usage.completion_tokens == sum(len(w.token_ids) for w in wants)


def test_echo_prepends_the_prompt(client, llm):
    r = client.completions.create(model="chatty", prompt=["def f(x):", [65, 66, 67]], max_tokens=5, temperature=0,
                                  echo=True)
    assert r.choices[0].text == "def f(x):" + offline(llm, "def f(x):", 5).text
    assert r.choices[1].text == "ABC" + offline(llm, [65, 66, 67], 5).text
    chunks = list(client.completions.create(model="chatty", prompt="def f(x):", max_tokens=5, temperature=0,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith("def f(x):")
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_first(client, llm):
    """echo with logprobs k: the prompt's tokens, then the completion's, in one logprobs object
    (the first token's logprob and top_logprobs null, text offsets from 0), each as the engine's
    prompt_logprobs and logprobs give them; streamed, the first chunk carries the prompt's; each
    of n choices echoes the same scores."""
    k, prompt = 2, "def f(x):"
    ids = llm.tokenizer.encode(prompt).ids
    [want] = llm.generate([ids], SamplingParams(max_tokens=5, logprobs=k, prompt_logprobs=k), use_tqdm=False)
    r = client.completions.create(model="chatty", prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=k)
    [c] = r.choices
    lp = c.logprobs

    def text(t):
        return llm.tokenizer.decode([t], skip_special_tokens=False)

    assert c.text == prompt + want.text
    assert lp.tokens == [text(t) for t in ids + want.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    entries = want.prompt_logprobs[1:] + want.outputs[0].logprobs
    assert lp.token_logprobs[1:] == pytest.approx([e[t].logprob for e, t in zip(entries, ids[1:] + want.token_ids)],
                                                  abs=LOGPROB_ATOL)
    for got, entry in zip(lp.top_logprobs[1:], entries):
        expected = {}
        for t, e in entry.items():          # the token's, then the k most probable (one entry per text)
            expected[text(t)] = e.logprob
        assert list(got) == list(expected) and list(got.values()) == pytest.approx(list(expected.values()),
                                                                                   abs=LOGPROB_ATOL)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = [ch.choices[0] for ch in client.completions.create(model="chatty", prompt=prompt, max_tokens=5,
                                                                temperature=0, echo=True, logprobs=k, stream=True)]
    assert chunks[0].text.startswith(prompt) and len(chunks[0].logprobs.tokens) == len(ids) + 1
    # the same server computes the same request again: the same values, bitwise
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for ch in chunks for x in getattr(ch.logprobs, field)] == getattr(lp, field), field
    r = client.completions.create(model="chatty", prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=0,
                                  n=2)
    for c in r.choices:
        # n=2: both completions' prompts may prefill in one step, a program over two rows (the JAX
        # engine's prefill step): float32 GEMMs over more rows may round otherwise
        assert c.logprobs.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs[:len(ids)], abs=LOGPROB_ATOL)


def test_streamed_completion_logprobs_equal_the_engine(client, llm):
    want = offline(llm, "while True:", 10)
    chunks = [c.choices[0] for c in client.completions.create(model="chatty", prompt="while True:", max_tokens=10,
                                                              temperature=0, logprobs=0, stream=True)]
    assert "".join(c.text for c in chunks) == want.text and len(chunks) == len(want.token_ids)
    assert [lp for c in chunks for lp in c.logprobs.token_logprobs] == pytest.approx(want.logprobs, abs=LOGPROB_ATOL)
    offsets = [o for c in chunks for o in c.logprobs.text_offset]
    tokens = [t for c in chunks for t in c.logprobs.tokens]
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]


MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]


def test_chat_completion_renders_the_template_and_equals_the_engine(client, llm):
    want = offline(llm, llm.tokenizer.encode(render(MESSAGES), add_special_tokens=False).ids, 10)
    assert want.prompt_token_ids[0] == 256                     # bos_token is the special token, not its text
    r = client.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=0)
    [c] = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and c.message.content == want.text and c.finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    assert [e.logprob for e in c.logprobs.content] == pytest.approx(want.logprobs, abs=LOGPROB_ATOL)
    assert all(e.top_logprobs == [] and bytes(e.bytes).decode() == e.token for e in c.logprobs.content)


def test_chat_default_max_tokens_is_what_max_model_len_leaves(client):
    r = client.chat.completions.create(model="chatty", messages=MESSAGES, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == ENGINE["max_model_len"]
    assert r.choices[0].finish_reason == "length"


def test_chat_stream_sends_the_role_then_the_content(client, llm):
    want = offline(llm, llm.tokenizer.encode(render(MESSAGES), add_special_tokens=False).ids, 8)
    chunks = list(client.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    first, *rest, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content for c in rest) == want.text and len(rest) == len(want.token_ids)
    assert [c.choices[0].finish_reason for c in rest] == [None] * (len(rest) - 1) + [want.finish_reason]
    assert usage.choices == [] and usage.usage.completion_tokens == len(want.token_ids)


def test_tokenize_and_detokenize_round_trip(server, llm):
    text = "def f(x):\n    return x  # é€"
    status, body = server.post({"prompt": text, "return_token_strs": True}, "/tokenize")
    ids = llm.tokenizer.encode(text).ids
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] == 96
    assert body["token_strs"] == [llm.tokenizer.id_to_token(t) for t in ids]
    status, body = server.post({"tokens": ids}, "/detokenize")
    assert status == 200 and body == {"prompt": text}
    status, body = server.post({"messages": MESSAGES}, "/tokenize")
    assert status == 200 and body["tokens"] == llm.tokenizer.encode(render(MESSAGES), add_special_tokens=False).ids
    assert body["token_strs"] is None


def completion_ids(llm, prompt, max_tokens, **params):
    """-> the engine's RequestOutput for one prompt (text or ids), greedy unless params say otherwise."""
    ids = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt).ids
    [out] = llm.generate([ids], SamplingParams(max_tokens=max_tokens, **params), use_tqdm=False)
    return out


def test_n_with_a_seed_equals_single_requests_with_seed_plus_i(client):
    """The engine's rule: completion i of a seeded n request samples as a request of seed + i;
    stop strings end each completion on its own."""
    kw = dict(model="chatty", prompt="def fib(n):", max_tokens=10, temperature=2.0, stop=["\n\n", ")"])
    r = client.completions.create(n=3, seed=11, **kw)
    singles = [client.completions.create(seed=11 + i, **kw) for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [(c.text, c.finish_reason) for c in r.choices] == [(s.choices[0].text, s.choices[0].finish_reason)
                                                              for s in singles]
    assert len({c.text for c in r.choices}) > 1                   # sampled: the completions differ
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def assert_same_top(a: dict, b: dict) -> None:
    """One position's top logprobs from two runs whose batches differ: the same values (within
    LOGPROB_ATOL, ranked), and the same tokens but at a near tie at the cut-off, where a token
    of one run only has the logprob of the other's last within LOGPROB_ATOL."""
    assert sorted(a.values(), reverse=True) == pytest.approx(sorted(b.values(), reverse=True), abs=LOGPROB_ATOL)
    for x, y in ((a, b), (b, a)):
        for token in x.keys() - y.keys():
            assert abs(x[token] - min(y.values())) <= 2 * LOGPROB_ATOL, (a, b)


def test_several_prompts_with_n_index_prompt_times_n_plus_i_and_stream_the_same(client):
    prompts = ["import os\n", "x = ["]
    kw = dict(model="chatty", max_tokens=6, temperature=2.0, seed=3, logprobs=2)
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for i in range(2):
            assert r.choices[p * 2 + i].text == client.completions.create(prompt=prompt, **{**kw, "seed": 3 + i}
                                                                          ).choices[0].text
    texts, reasons, tops, usage = [""] * 4, [None] * 4, [[] for _ in range(4)], None
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                           **kw):
        if not chunk.choices:
            usage = chunk.usage
        for c in chunk.choices:
            assert reasons[c.index] is None                        # nothing after a choice's last chunk
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason
            tops[c.index] += c.logprobs.top_logprobs
    assert texts == [c.text for c in r.choices] and reasons == [c.finish_reason for c in r.choices]
    for top, c in zip(tops, r.choices):                            # two runs: batch shapes may differ
        assert len(top) == len(c.logprobs.top_logprobs)
        for streamed, whole in zip(top, c.logprobs.top_logprobs):
            assert_same_top(streamed, whole)
    assert usage.completion_tokens == r.usage.completion_tokens


def test_chat_n_streamed_equals_non_streamed(client):
    kw = dict(model="chatty", messages=MESSAGES, max_tokens=6, temperature=2.0, seed=5, n=2)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.content != r.choices[1].message.content
    single = client.chat.completions.create(**{**kw, "n": 1, "seed": 6})
    assert single.choices[0].message.content == r.choices[1].message.content
    texts, roles = ["", ""], [None, None]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            roles[c.index] = roles[c.index] or c.delta.role
            texts[c.index] += c.delta.content or ""
    assert roles == ["assistant"] * 2 and texts == [c.message.content for c in r.choices]


PROCESSED = [dict(presence_penalty=1.5, frequency_penalty=1.0, extra_body={"repetition_penalty": 1.5}),
             dict(logit_bias={"41": 6.0, "10": -100}, extra_body={"min_tokens": 8}),
             dict(stop=[" "], extra_body={"include_stop_str_in_output": True, "min_tokens": 3})]   # "\n  "


@pytest.mark.parametrize("kw", PROCESSED, ids=["penalties", "logit_bias+min_tokens", "include_stop"])
def test_penalties_logit_bias_and_stop_options_decode_as_the_engine(client, llm, kw):
    """Greedy: the server's tokens and text equal the offline engine's under the same
    SamplingParams, and differ from plain greedy decoding (the fields take effect)."""
    extra = kw.get("extra_body", {})
    params = {**{k: v for k, v in kw.items() if k != "extra_body"}, **extra}
    if "logit_bias" in params:
        params["logit_bias"] = {int(t): b for t, b in params["logit_bias"].items()}
    want = completion_ids(llm, "def fib(n):", 12, **params)
    plain = completion_ids(llm, "def fib(n):", 12)
    r = client.completions.create(model="chatty", prompt="def fib(n):", max_tokens=12, temperature=0,
                                  **{**kw, "extra_body": {**extra, "return_token_ids": True}})
    [c] = r.choices
    assert (c.model_extra["token_ids"], c.text, c.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert (want.token_ids, want.text) != (plain.token_ids, plain.text)
    if "stop" in params:                                          # the stop string ends the text, kept in it
        assert c.text.endswith(" ") and len(want.token_ids) == 3 and c.finish_reason == "stop"


def test_top_logprobs_equal_the_engines(client, llm):
    text = lambda t: llm.tokenizer.decode([t], skip_special_tokens=False)   # noqa: E731
    [want] = completion_ids(llm, "class Stack:", 6, logprobs=5).outputs
    r = client.completions.create(model="chatty", prompt="class Stack:", max_tokens=6, temperature=0, logprobs=5)
    got = r.choices[0].logprobs.top_logprobs
    assert len(got) == len(want.logprobs) == 6
    for entry, g in zip(want.logprobs, got):
        assert len(entry) in (5, 6)                               # the top 5, and the chosen one if not among them
        assert g == pytest.approx({text(t): lp.logprob for t, lp in entry.items()}, abs=LOGPROB_ATOL)
    ids = llm.tokenizer.encode(render(MESSAGES), add_special_tokens=False).ids
    [want] = completion_ids(llm, ids, 5, logprobs=3).outputs
    r = client.chat.completions.create(model="chatty", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.logprobs) == 5
    for entry, e in zip(want.logprobs, content):
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:3]
        assert [a.token for a in e.top_logprobs] == [text(t) for t, _ in top]
        assert [a.logprob for a in e.top_logprobs] == pytest.approx([lp.logprob for _, lp in top], abs=LOGPROB_ATOL)
        assert all(bytes(a.bytes).decode() == a.token for a in e.top_logprobs)


BAD = [
    ("completions", dict(prompt="a", n=2, best_of=3), "best_of=3 is not supported by this server"),
    ("completions", dict(prompt="a", n=0), "n must be an integer in [1, 128], got 0"),
    ("completions", dict(prompt="a", logprobs=21), "logprobs must be an integer in [0, 20]"),
    ("completions", dict(prompt="a", frequency_penalty=2.5), "frequency_penalty must be a number in [-2, 2], got 2.5"),
    ("completions", dict(prompt="a", presence_penalty=-3), "presence_penalty must be a number in [-2, 2], got -3"),
    ("completions", dict(prompt="a", extra_body={"repetition_penalty": 0}), "repetition_penalty must be a number in"),
    ("completions", dict(prompt="a", logit_bias={"1": 100.5}), "logit_bias['1'] must be a number in [-100, 100]"),
    ("completions", dict(prompt="a", logit_bias={"258": 1}), "logit_bias names token ids [258] outside the vocab"),
    ("completions", dict(prompt="a", extra_body={"min_tokens": 5}), "min_tokens (5) is more than max_tokens (4)"),
    ("completions", dict(prompt="a" * 1300), "the prompt is 1300 characters, more than the 1248 bytes"),
    ("completions", dict(prompt=["a", "é" * 700]), "the prompt is 1400 bytes, more than the 1248 bytes"),
    ("completions", dict(prompt=["a", "b" * 90], max_tokens=16), "more than max_model_len (96)"),
    ("completions", dict(prompt=[[1]] * 2 + [list(range(97))]), "the prompt holds 97 token ids, more than"),
    ("chat", dict(messages=MESSAGES, top_logprobs=21, logprobs=True), "top_logprobs must be an integer in [0, 20]"),
    ("chat", dict(messages=MESSAGES, n=129), "n must be an integer in [1, 128], got 129"),
    ("chat", dict(messages=MESSAGES, logit_bias={"x": 1}), "logit_bias keys must be token ids"),
    ("chat", dict(messages=[{"role": "tool", "content": "x"}]), "the chat template refused the messages: no tools"),
    ("chat", dict(messages=[{"role": "user", "content": "a" * 80}], max_tokens=None),      # null: the default
     "the prompt holds 101 tokens: max_model_len (96) leaves no room for a completion"),
    ("chat", dict(messages=[{"role": "user", "content": "a" * 2000}]), "the messages is 20"),
]


@pytest.mark.parametrize("endpoint, kw, message", BAD, ids=[m for *_, m in BAD])
def test_bad_requests_are_400s_naming_the_problem(server, client, endpoint, kw, message):
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    kw = dict(kw)                                             # the case's own dict serves every backend
    with pytest.raises(openai.BadRequestError) as e:
        create(model="chatty", max_tokens=kw.pop("max_tokens", 4), **kw)
    assert message in e.value.body["message"], e.value.body
    m = server.wait_idle()                                    # nothing left queued or holding pages
    assert m["wise_kv_pages_free"] == m["wise_kv_pages_total"]


def test_one_access_log_line_per_request(server, client):
    r = client.completions.create(model="chatty", prompt="import", max_tokens=3, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="chatty", prompt="a", max_tokens=3, n=0)
    raw = client.chat.completions.with_raw_response.create(model="chatty", messages=MESSAGES, max_tokens=2)
    chat_id = raw.parse().id
    assert raw.headers["X-Request-Id"] == chat_id
    server.request("GET", "/health")
    log = server.log_path.read_text()
    line = re.compile(r'wise_serve\.access: (\S+) "(\S+) (\S+)" (\S+)(?: prompt_tokens=(\d+) completion_tokens=(\d+))? '
                      r'(\d+\.\d+)s$', re.M)
    lines = {m[1]: m.groups() for m in line.finditer(log)}
    got = lines[r.id]
    assert got[1:6] == ("POST", "/v1/completions", "200", str(r.usage.prompt_tokens),
                        str(r.usage.completion_tokens))
    assert lines[chat_id][1:4] == ("POST", "/v1/chat/completions", "200")
    assert any(m[2:4] == ("/v1/completions", "400") and m[4] is None for m in lines.values())
    assert any(m[2:4] == ("/health", "200") for m in lines.values())
    assert len(line.findall(log)) == sum("wise_serve.access:" in x for x in log.splitlines())
