"""Text <-> token ids for a Hugging Face model directory, over the `tokenizers` library alone.

Special token ids come from the files a Hugging Face directory carries: `tokenizer_config.json`
(bos/eos token strings, `add_bos_token` / `add_eos_token`), `generation_config.json` and
`config.json` (`bos_token_id`, `eos_token_id` as an int or a list). The chat template (if any)
comes from `chat_template.jinja` or tokenizer_config.json (see `slora_core.chat_template`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import tokenizers

from slora_core.chat_template import ChatTemplate, ChatTemplateError, load_chat_template

# tokenizers' incremental decoder (0.21 on; None before). Whether it can be primed with context
# ids, and primes as TextStream's window needs, is checked on a probe (`_decode_stream_primes`).
_DECODE_STREAM: Any = getattr(tokenizers.decoders, "DecodeStream", None)
# Text whose tokens a primed DecodeStream must stream back exactly (multi-byte characters
# included), once per tokenizer.
_STREAM_PROBE = "Hello, wörld! 你好 😀 done."


class TokenizerError(ValueError):
    """A model directory whose tokenizer files are missing or cannot be read."""


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file does not exist."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as plain strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value if v is not None]
    return [] if value is None else [int(value)]


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise TokenizerError(f"{path} not found: the model directory needs a tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for any parse failure
        raise TokenizerError(f"{path} is not a valid tokenizers file: {e}") from None


class Tokenizer:
    """Encodes text to ids (with BOS when the model expects it) and decodes ids to text.

    `add_bos_token=None` means "do what tokenizer.json's post-processor does" (Llama 3, Qwen2);
    True/False (Llama 2, Mistral) overrides it: ids are encoded without the post-processor's
    special tokens and BOS (and EOS when `add_eos_token`) is added here, never twice."""

    def __init__(self, backend: tokenizers.Tokenizer, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos_token: bool | None = None,
                 add_eos_token: bool = False, chat_template: ChatTemplate | None = None) -> None:
        if add_bos_token and bos_token_id is None:
            raise TokenizerError("add_bos_token is set but the tokenizer has no BOS token")
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        self._primes: bool | None = None  # see _decode_stream_primes

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and the special-token settings of a Hugging Face directory.

        Raises TokenizerError when tokenizer.json is missing or invalid, a config file is not
        valid JSON, or the chat template cannot be used (bad form, does not compile). EOS ids are the union of generation_config.json, config.json and the
        tokenizer config's eos token, in that order."""
        root = Path(model_dir)
        backend = _load_backend(root / "tokenizer.json")
        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")

        def token_id(name: str) -> list[int]:
            content = _token_content(tok_cfg.get(name))
            tid = backend.token_to_id(content) if content is not None else None
            return [] if tid is None else [tid]

        bos = token_id("bos_token") or _ids(gen_cfg.get("bos_token_id")) or _ids(
            model_cfg.get("bos_token_id"))
        eos = (_ids(gen_cfg.get("eos_token_id")) + _ids(model_cfg.get("eos_token_id"))
               + token_id("eos_token"))
        add_bos = tok_cfg.get("add_bos_token")
        try:
            template = load_chat_template(root, tok_cfg, _read_json(root / "special_tokens_map.json"))
        except ChatTemplateError as e:
            raise TokenizerError(f"{root}: {e}") from None
        return cls(backend, bos[0] if bos else None, eos,
                   add_bos_token=None if add_bos is None else bool(add_bos),
                   add_eos_token=bool(tok_cfg.get("add_eos_token", False)),
                   chat_template=template)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (read-only use)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the model's BOS/EOS when `add_special_tokens`."""
        if self.add_bos_token is None:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        ids = list(self._backend.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token and self.eos_token_ids:
            ids.append(self.eos_token_ids[0])
        return ids

    @property
    def has_chat_template(self) -> bool:
        """The model directory carries a chat template (chat input is possible)."""
        return self.chat_template is not None

    def render_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text of a chat, as transformers' apply_chat_template(tokenize=False).
        Raises ChatTemplateError (no template, malformed messages, template refused them)."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (neither chat_template.jinja "
                                    "nor tokenizer_config.json chat_template): send a text prompt")
        return self.chat_template.render(messages, add_generation_prompt, **variables)

    def encode_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat prompt, as transformers' apply_chat_template(tokenize=True): the
        rendered text carries its own special tokens (BOS included), so none are added here.
        Raises ChatTemplateError like `render_chat`."""
        return self.encode(self.render_chat(messages, add_generation_prompt),
                           add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form complete UTF-8 characters become U+FFFD."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_stream(self, context: Sequence[int], skip_special_tokens: bool = True,
                      ) -> Callable[[int], str | None] | None:
        """An incremental decoder in the tokenizers library (Rust), primed with `context` ids
        whose text it does not return: `step(id)` appends one id and returns the new text once
        it ends in a complete character (None until then), decoding a window of ids as
        `TextStream` does. Raises when a window's text stops extending its prefix. None when
        the installed tokenizers has no DecodeStream that primes so."""
        if _DECODE_STREAM is None or not self._decode_stream_primes():
            return None
        stream = _DECODE_STREAM(ids=list(context), skip_special_tokens=skip_special_tokens)
        return cast(Callable[[int], str | None], partial(stream.step, self._backend))

    def _decode_stream_primes(self) -> bool:
        """Whether a DecodeStream primed with context ids returns the text after them and only
        that, checked once on a probe: priming came late to tokenizers and its versions need
        not agree (a stream that also returned the context's text would repeat the prompt)."""
        if self._primes is None:
            ids = self.encode(_STREAM_PROBE, add_special_tokens=False)
            context, head, full = ids[:2], self.decode(ids[:2]), self.decode(ids)
            try:
                stream = _DECODE_STREAM(ids=context, skip_special_tokens=True)
                got = "".join(stream.step(self._backend, t) or "" for t in ids[2:])
            except Exception:  # noqa: BLE001 - any failure: the Python window instead
                got = None
            self._primes = full.startswith(head) and got == full[len(head):]
        return self._primes

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (e.g. a special token string), None if absent."""
        tid = self._backend.token_to_id(token)
        return None if tid is None else int(tid)
