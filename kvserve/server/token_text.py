"""Single tokens as OpenAI's logprobs show them: a string and the token's raw UTF-8 bytes.

Decoding one token alone loses information: a byte-level BPE token may hold half of a
multi-byte character (decode gives U+FFFD), and sentencepiece decoders strip a leading
space. The token's own piece keeps the exact bytes, so they are read from there.
"""
from __future__ import annotations

import functools
import re
from typing import Callable

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SENTENCEPIECE_SPACE = "\u2581"


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _is_byte_level(tokenizer) -> bool:
    hf = getattr(tokenizer, "hf", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


class TokenText:
    """Token id -> (display string, UTF-8 bytes), cached."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        hf = getattr(tokenizer, "hf", tokenizer)
        self.special_ids: frozenset[int] = frozenset(getattr(hf, "all_special_ids", None) or ())
        self.token_bytes: Callable[[int], bytes] = functools.lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens([int(token_id)])[0]
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode("utf-8")  # an added/special token, stored as plain text
        match = _BYTE_PIECE.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")

    def text(self, token_id: int) -> str:
        # A token holding part of a character shows its bytes escaped, as OpenAI does.
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")
