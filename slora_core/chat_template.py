"""Chat templates rendered the way Hugging Face `apply_chat_template` renders them.

A model directory carries its template as `chat_template.jinja` (which wins, as in transformers)
or as `chat_template` in tokenizer_config.json: a string, or a list of {"name", "template"} of
which "default" is used. The template is Jinja2 run in an immutable sandbox (templates come from
model repositories: untrusted code) with transformers' settings and helpers: trim_blocks,
lstrip_blocks, loop controls, the `{% generation %}` tag, `raise_exception`, `strftime_now`, a
`tojson` that does not escape HTML, and a `namespace` that refuses underscore names. It sees
`messages`, `add_generation_prompt`, `tools`/`documents` (None) and the special tokens
(`bos_token`, `eos_token`, ...) of tokenizer_config.json.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a template may read the token strings by.
SPECIAL_TOKEN_NAMES: tuple[str, ...] = ("bos_token", "eos_token", "unk_token", "sep_token",
                                        "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """Chat input that cannot be rendered: the model has no (usable) template, the messages are
    malformed, or the template refused them (e.g. roles that do not alternate)."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore attributes (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore attributes on a namespace ({name!r})")


class _DictMaker:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; rendering keeps the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictMaker()
    env.globals["namespace"] = _Namespace
    return env


def check_messages(messages: object) -> list[dict[str, str]]:
    """A non-empty list of {"role": str, "content": str, other str fields...} as plain dicts.

    Which roles are allowed, and in which order, is the template's business; None-valued
    fields are dropped as transformers drops them."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with role and content")
        msg = {str(k): v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                raise ChatTemplateError(f"messages[{i}].{key} must be a string")
        if not msg["role"]:
            raise ChatTemplateError(f"messages[{i}].role is empty")
        # tool_calls: an assistant turn's calls (a list of objects), as transformers takes them.
        bad = sorted(k for k, v in msg.items()
                     if not isinstance(v, str) and not (k == "tool_calls" and isinstance(v, list)))
        if bad:
            raise ChatTemplateError(f"messages[{i}]: fields {bad} must be strings")
        out.append(msg)
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template with the special-token strings it is rendered with."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not compile: {e} "
                                    f"(line {e.lineno})") from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: Sequence[Mapping[str, str]],
               add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for `messages` (checked with `check_messages`), ending with the
        assistant header when `add_generation_prompt`; `variables` are extra template variables
        (vLLM's chat_template_kwargs). Raises ChatTemplateError."""
        chat = check_messages(messages)
        try:
            return str(self._compiled.render(**{"tools": None, "documents": None, **variables},
                                             messages=chat,
                                             add_generation_prompt=add_generation_prompt,
                                             **self.special_tokens))
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template refused the messages: {e}"
                                    ) from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            # A template that assumes fields or types these messages lack.
            raise ChatTemplateError(f"the model's chat template failed on these messages: "
                                    f"{type(e).__name__}: {e}") from None


def _token_string(value: object) -> str | None:
    # Special tokens are plain strings or AddedToken dicts ({"content": ...}).
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tokenizer_config: Mapping[str, Any],
                   special_tokens_map: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The named special-token strings a template sees, plus named `extra_special_tokens`.

    As in transformers, the legacy special_tokens_map.json overrides tokenizer_config.json
    only when the latter predates `added_tokens_decoder`."""
    merged: dict[str, Any] = dict(tokenizer_config)
    if "added_tokens_decoder" not in tokenizer_config:
        merged.update(special_tokens_map or {})
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = _token_string(merged.get(name))
        if token is not None:
            out[name] = token
    extra = tokenizer_config.get("extra_special_tokens")
    if isinstance(extra, Mapping):  # transformers 5: named model-specific tokens
        out.update({str(k): t for k, v in extra.items() if (t := _token_string(v)) is not None})
    return out


def _template_source(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = tokenizer_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise ChatTemplateError(f"tokenizer_config.json lists chat templates {sorted(map(str, named))} "
                                f"but none named 'default'")
    raise ChatTemplateError("tokenizer_config.json chat_template must be a string or a list of "
                            f"named templates, got {type(value).__name__}")


def load_chat_template(model_dir: str | Path, tokenizer_config: Mapping[str, Any],
                       special_tokens_map: Mapping[str, Any] | None = None
                       ) -> ChatTemplate | None:
    """The model directory's chat template, None when it has none. Raises ChatTemplateError
    for a template that cannot be used (bad form, does not compile)."""
    source = _template_source(Path(model_dir), tokenizer_config)
    if source is None:
        return None
    return ChatTemplate(source, special_tokens(tokenizer_config, special_tokens_map))
