"""The torch-free fake model the scheduler tests share: each token a deterministic function of
the whole sequence before it, so a test that reads a sequence back out of a simulated paged KV
store (through the block tables the scheduler hands out) sees any block shared, reused, evicted
or rolled back wrongly as a changed token."""
from __future__ import annotations

from typing import Optional, Sequence

VOCAB = 32
EOS = 0


def next_token(tokens: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    acc = 0
    for i, t in enumerate(tokens):
        acc = (acc * 31 + (i + 1) * (t + 7)) % 1_000_003
    return acc % VOCAB


def reference(prompt: Sequence[int], max_tokens: int, eos: Optional[int] = None) -> list[int]:
    """Tokens the request generates when run alone, with no cache at all."""
    seq, out = list(prompt), []
    while True:
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
        if tok == eos or len(out) >= max_tokens:
            return out


def paged_slot(block_ids: Sequence[int], block_size: int, pos: int) -> int:
    """The KV slot of position ``pos`` of a sequence with these blocks."""
    return block_ids[pos // block_size] * block_size + pos % block_size
