"""The engine's per-token logprobs ({token_id: Logprob}: the sampled token plus the top
alternatives) in OpenAI's two shapes: completions (parallel lists) and chat (a list of
token objects)."""
from __future__ import annotations

import math
from typing import Container, Optional

from kvserve.request import Logprob
from kvserve.server.protocol import (ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs,
                                     TopLogprob)
from kvserve.server.token_text import TokenText

# JSON has no -inf; OpenAI and vLLM clip to this.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def _top(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
    return ranked[:num_top]


def completion_logprobs(entries: list[Optional[dict[int, Logprob]]], token_ids: list[int], num_top: int,
                        token_text: TokenText, text_offset: int = 0,
                        omitted: Container[int] = (), text_length: Optional[int] = None
                        ) -> tuple[CompletionLogprobs, int]:
    """``text_offset``: where the first of these tokens starts in the returned text.
    ``omitted``: positions (in ``token_ids``) of tokens the returned text leaves out (an
    echoed prompt's BOS): they take no room. ``text_length``: the length of the text these
    tokens make (an echoed prompt), which no offset passes, so that the offsets never go
    backwards into the generated tokens' (a sentencepiece token's leading space may be no
    character of the text). Returns the logprobs and the offset just past the last token
    (for the next stream chunk)."""
    out = CompletionLogprobs()
    for position, (token_id, entry) in enumerate(zip(token_ids, entries)):
        text = token_text.text(token_id)
        out.tokens.append(text)
        if entry is None:  # the first prompt token: nothing predicts it
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            chosen: Optional[Logprob] = entry.get(token_id)
            out.token_logprobs.append(_finite(chosen.logprob) if chosen else None)
            top = {token_text.text(t): _finite(lp.logprob) for t, lp in _top(entry, num_top)}
            if chosen is not None:
                top.setdefault(text, _finite(chosen.logprob))
            out.top_logprobs.append(top)
        if text_length is not None:
            text_offset = min(text_offset, text_length)
        out.text_offset.append(text_offset)
        if position in omitted:
            continue
        # Offsets count characters of the text; a token holding part of a character adds none.
        text_offset += len(token_text.token_bytes(token_id).decode("utf-8", errors="ignore"))
    return out, text_offset


def chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], num_top: int,
                  token_text: TokenText) -> ChatChoiceLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        content.append(ChatTokenLogprob(
            token=token_text.text(token_id),
            logprob=_finite(chosen.logprob) if chosen else _MIN_LOGPROB,
            bytes=list(token_text.token_bytes(token_id)),
            top_logprobs=[TopLogprob(token=token_text.text(t), logprob=_finite(lp.logprob),
                                     bytes=list(token_text.token_bytes(t)))
                          for t, lp in _top(entry, num_top)]))
    return ChatChoiceLogprobs(content=content)


def concat_completion_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """The prompt's logprobs (echo) followed by the generated tokens'."""
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + second.text_offset)
