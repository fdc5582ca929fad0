"""Tokens as OpenAI's logprobs show them: each token's own bytes and their text.

A token's bytes come from its vocabulary entry: byte-level BPE entries (GPT-2, Llama 3, Qwen2)
map back through the byte-to-character table, SentencePiece byte-fallback entries (`<0xE2>`)
are that byte, other SentencePiece pieces read `▁` as a space, added tokens are their content.
The text is those bytes decoded (U+FFFD where a token holds part of a character, as OpenAI
shows it). Both are cached per id: the vocabulary is bounded.
"""

from __future__ import annotations

import re

import tokenizers
from tokenizers import decoders

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, reversed: the character each byte is written as -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


BYTE_DECODER = _byte_decoder()


class TokenText:
    """(text, bytes) of token ids for one tokenizer."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self._byte_level = _is_byte_level(backend.decoder)
        self._added = {int(i): t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def of(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self.token_bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return hit

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(ch in BYTE_DECODER for ch in piece):
            return bytes(BYTE_DECODER[ch] for ch in piece)
        m = _BYTE_PIECE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


def _is_byte_level(decoder: object) -> bool:
    if isinstance(decoder, decoders.ByteLevel):
        return True
    # A Sequence decoder's parts are not exposed; its repr names them.
    return decoder is not None and "ByteLevel" in repr(decoder)
