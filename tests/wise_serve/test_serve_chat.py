"""wise_serve.chat: where a checkpoint's chat template comes from and how it renders (as transformers)."""

import json

import pytest

from wise_core.tokenizer import byte_tokenizer
from wise_serve.chat import ChatTemplate, TemplateError, load_chat_template

USER = [{"role": "user", "content": "héllo"}]


def load(directory, override=None):
    return load_chat_template(str(directory), override, tokenizer=byte_tokenizer(), bos_token_id=256,
                              eos_token_id=256)


def test_the_template_comes_from_the_file_then_jinja_file_then_tokenizer_config(tmp_path):
    assert load(tmp_path) is None                                        # a directory without one
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}],
         "eos_token": {"content": "</s>", "lstrip": False}}))
    t = load(tmp_path)
    assert t.render(USER) == "D</s>" and t.bos_token == "<|endoftext|>"  # bos from the tokenizer's id
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load(tmp_path).render(USER) == "J"
    override = tmp_path / "mine.jinja"
    override.write_text("{{ bos_token }}M")
    assert load(tmp_path, str(override)).render(USER) == "<|endoftext|>M"
    with pytest.raises(ValueError, match="--chat-template .*nope.jinja: no such file"):
        load(tmp_path, str(tmp_path / "nope.jinja"))
    override.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="mine.jinja: the chat template is not valid Jinja"):
        load(tmp_path, str(override))
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer_config.json: not a readable JSON file"):
        load(tmp_path)


def test_rendering_follows_transformers_settings():
    # trim_blocks and lstrip_blocks drop a block tag's newline and indentation; tojson keeps
    # non-ASCII text; loopcontrols gives break / continue; add_generation_prompt reaches it.
    source = ("{% for m in messages %}\n"
              "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
              "[{{ m.content | tojson }}]\n"
              "{% endfor %}\n"
              "{% if add_generation_prompt %}>{% endif %}")
    t = ChatTemplate(source, bos_token=None, eos_token=None, origin="t")
    messages = [{"role": "system", "content": "s"}, *USER]
    assert t.render(messages) == '["héllo"]\n>'
    assert t.render(messages, add_generation_prompt=False) == '["héllo"]\n'


def test_a_template_that_refuses_or_fails_is_a_template_error():
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}", bos_token=None, eos_token=None, origin="t")
    with pytest.raises(TemplateError, match="the chat template refused the messages: roles must alternate"):
        t.render(USER)
    t = ChatTemplate("{{ messages[5].content }}", bos_token=None, eos_token=None, origin="t")
    with pytest.raises(TemplateError, match=r"the chat template \(t\) failed on the messages"):
        t.render(USER)
    t = ChatTemplate("{{ messages.append(1) }}", bos_token=None, eos_token=None, origin="t")   # the sandbox
    with pytest.raises(TemplateError):
        t.render(USER)
