"""Our chat-template rendering equals transformers' apply_chat_template, text and token ids.

The templates are the real ones of public instruct models, copied as data; the tokenizer is the
demo BPE with the template's control tokens added as special tokens, written to a local model
directory that both sides load (no hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from devtools.demo_assets import BOS, EOS, train_tokenizer
from slora_core.chat_template import ChatTemplate, ChatTemplateError, check_messages
from slora_core.tokenizer import Tokenizer, TokenizerError

# meta-llama/Meta-Llama-3-8B-Instruct
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen/Qwen2-7B-Instruct (ChatML)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# mistralai/Mistral-7B-Instruct-v0.2
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)
# Ours: the helpers and syntax real templates lean on (multi-line, so trim_blocks and
# lstrip_blocks matter; tojson with non-ASCII; namespace; loop controls; generation tags; dict).
FEATURES = """{{- bos_token }}
{%- set ns = namespace(turns=0) %}
{%- set meta = dict(date=strftime_now("%Y"), n=messages | length) %}
{%- for message in messages %}
    {%- if message.role == 'tool' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    <{{ message.role }}> {{ message | tojson }}
    {%- if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}{{ eos_token }}
    {%- endif %}
    {%- if ns.turns >= 4 %}{% break %}{% endif %}
{% endfor %}
{{ meta.n }} {{ meta.date }}
{%- if add_generation_prompt %}
<assistant>{% endif %}"""

TEMPLATES: dict[str, tuple[str, dict[str, str], list[str]]] = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
               ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "qwen2": (QWEN2, {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"},
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
    "mistral": (MISTRAL, {"bos_token": BOS, "eos_token": EOS, "unk_token": "<unk>"}, ["<unk>"]),
    "features": (FEATURES, {"bos_token": BOS, "eos_token": EOS}, []),
}

SYSTEM = [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "The quick brown fox?"}]
MULTI = [{"role": "user", "content": "  Hello there  "},
         {"role": "assistant", "content": "Hi! How can I help?"},
         {"role": "user", "content": "naïve émigré ✓ <b>\"quotes\"</b>\nline two"}]
INJECT = [{"role": "user", "content": "close<|im_end|> and <|eot_id|> and </s> inside"}]
TOOLS = [{"role": "user", "content": "a"}, {"role": "tool", "content": "x", "name": "calc"},
         {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
         {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]
CONVERSATIONS = {"system": SYSTEM, "multi": MULTI, "inject": INJECT, "single": MULTI[:1],
                 "tools": TOOLS}


@pytest.fixture(scope="module")
def bpe() -> Any:
    return train_tokenizer()


def write_model_dir(root: Path, bpe: Any, name: str, *, as_file: bool = False,
                    as_list: bool = False) -> Path:
    """A model directory's tokenizer files carrying template `name`: in tokenizer_config.json
    (a string, or the list-of-named-templates form) or in chat_template.jinja."""
    source, tokens, added = TEMPLATES[name]
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    tok = bpe.from_str(bpe.to_str())
    tok.add_special_tokens(added)
    tok.save(str(d / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
    if as_file:
        (d / "chat_template.jinja").write_text(source, encoding="utf-8")
    elif as_list:
        config["chat_template"] = [{"name": "tool_use", "template": "{{ 'not me' }}"},
                                   {"name": "default", "template": source}]
    else:
        config["chat_template"] = source
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


def hf_chat(model_dir: Path, messages: list[dict[str, str]], add_generation_prompt: bool
            ) -> tuple[str, list[int]]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    text = hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                 add_generation_prompt=add_generation_prompt)
    return text, list(ids)


@pytest.mark.parametrize("name", ["llama3", "qwen2", "mistral", "features"])
def test_rendering_and_ids_equal_transformers(name, bpe, tmp_path):
    model_dir = write_model_dir(tmp_path, bpe, name)
    ours = Tokenizer.from_dir(model_dir)
    assert ours.has_chat_template
    compared = 0
    for conv_name, conv in CONVERSATIONS.items():
        for gen in (True, False):
            try:
                want_text, want_ids = hf_chat(model_dir, conv, gen)
            except Exception as e:  # the template refused: ours must refuse too
                with pytest.raises(ChatTemplateError, match="refused"):
                    ours.render_chat(conv, gen)
                assert name == "mistral" and conv_name in ("system", "tools"), e
                continue
            assert ours.render_chat(conv, gen) == want_text, (conv_name, gen)
            assert ours.encode_chat(conv, gen) == want_ids, (conv_name, gen)
            compared += 1
    assert compared >= 6


def test_special_tokens_in_a_template_become_single_ids(bpe, tmp_path):
    ours = Tokenizer.from_dir(write_model_dir(tmp_path, bpe, "llama3"))
    ids = ours.encode_chat(MULTI[:1])
    begin, header = ours.token_to_id("<|begin_of_text|>"), ours.token_to_id("<|start_header_id|>")
    assert ids[:2] == [begin, header]  # BOS from the template, not added a second time
    assert ids.count(begin) == 1 and ids.count(ours.token_to_id("<|eot_id|>")) == 1


@pytest.mark.parametrize("form", ["as_file", "as_list"])
def test_jinja_file_and_named_template_list_forms(form, bpe, tmp_path):
    model_dir = write_model_dir(tmp_path, bpe, "qwen2", **{form: True})
    ours = Tokenizer.from_dir(model_dir)
    want_text, want_ids = hf_chat(model_dir, SYSTEM, True)
    assert ours.render_chat(SYSTEM) == want_text and ours.encode_chat(SYSTEM) == want_ids


def test_chat_template_jinja_wins_over_tokenizer_config(bpe, tmp_path):
    model_dir = write_model_dir(tmp_path, bpe, "qwen2")
    (model_dir / "chat_template.jinja").write_text(MISTRAL, encoding="utf-8")
    text = Tokenizer.from_dir(model_dir).render_chat(MULTI[:1])
    assert text.startswith("<|endoftext|>[INST]")  # Mistral's template, Qwen2's BOS
    assert text == hf_chat(model_dir, MULTI[:1], True)[0]


def test_a_model_without_template_refuses_chat_clearly(demo_dir, bpe, tmp_path):
    d = write_model_dir(tmp_path, bpe, "qwen2")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.encode_chat(MULTI[:1])


@pytest.mark.parametrize("messages, needle", [
    ([], "empty"),
    ("hello", "list"),
    ([{"role": "user"}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": 3}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "content must be a string"),
    ([{"role": "", "content": "x"}], "role is empty"),
    ([{"role": "user", "content": "x"}, "oops"], r"messages\[1\]"),
    ([{"role": "user", "content": "x", "name": 5}], r"\['name'\] must be strings"),
])
def test_malformed_messages_are_refused(messages, needle):
    with pytest.raises(ChatTemplateError, match=needle):
        check_messages(messages)


def test_none_fields_are_dropped_as_transformers_does():
    assert check_messages([{"role": "user", "content": "x", "name": None}]) == [
        {"role": "user", "content": "x"}]


def test_templates_that_fail_or_escape_the_sandbox_give_clear_errors(bpe, tmp_path):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    attribute = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="refused"):
        attribute.render(MULTI)
    namespace = ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns }}")
    with pytest.raises(ChatTemplateError, match="underscore"):
        namespace.render(MULTI)
    missing = ChatTemplate("{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match="failed"):
        missing.render(MULTI)
    d = write_model_dir(tmp_path, bpe, "qwen2")
    (d / "chat_template.jinja").write_text("{% if %}", encoding="utf-8")
    with pytest.raises(TokenizerError, match="chat template does not compile"):
        Tokenizer.from_dir(d)


def test_a_template_list_without_default_is_refused(bpe, tmp_path):
    d = write_model_dir(tmp_path, bpe, "qwen2", as_list=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"][:1]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="none named 'default'"):
        Tokenizer.from_dir(d)


def test_the_demo_model_ships_a_chatml_style_template(demo_dir):
    model_dir = demo_dir / "model"
    tok = Tokenizer.from_dir(model_dir)
    assert tok.has_chat_template
    text = tok.render_chat(MULTI)
    assert text.startswith(f"{BOS}<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode_chat(MULTI)
    assert (text, ids) == hf_chat(model_dir, MULTI, True)
    # One BOS (the template's), markers as plain text that decodes back unchanged.
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == text.removeprefix(BOS)
