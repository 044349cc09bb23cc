"""Prompt-lookup drafting: the n-gram drafter.

The last n tokens of the request (prompt and output) are looked up earlier in the same
sequence; the k tokens that followed the most recent earlier occurrence are the draft.
Input-grounded text (code being edited, a document being summarised) repeats spans of
its input, and these drafts are then accepted several at a time. Torch-free.
"""
from __future__ import annotations

from array import array
from typing import Sequence

_ITEM = 4  # bytes per token id in the search buffer (int32)


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default: the configured k) draft tokens to follow ``token_ids``."""
        k = self.k if k is None else k
        num = len(token_ids)
        if k <= 0 or num <= self.min_n:
            return []
        # bytes.rfind runs the search in C: microseconds for thousands of tokens.
        hay = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            needle = hay[(num - n) * _ITEM:]
            # The match must end before the last token, so at least one token follows it.
            end = (num - 1) * _ITEM
            while True:
                pos = hay.rfind(needle, 0, end)
                if pos < 0:
                    break
                if pos % _ITEM == 0:
                    return _copy_forward(token_ids, pos // _ITEM + n, k)
                end = pos + len(needle) - 1  # misaligned byte match: look further left
        return []


def _copy_forward(token_ids: Sequence[int], start: int, k: int) -> list[int]:
    """The k tokens from ``start`` on, continuing past the end of the sequence the way an
    LZ77 copy overlaps itself: a match d tokens back predicts a period-d repetition (a run
    of one token, a repeated line) for all k drafts, not just the tokens seen so far."""
    num = len(token_ids)
    distance = num - start  # the predicted token at position p is the one at p - distance
    out: list[int] = []
    for p in range(num, num + k):
        src = p - distance
        out.append(token_ids[src] if src < num else out[src - num])
    return out
