"""Verification: which drafts the target model accepts.

The runner samples the target's token at every drafted position in one batched sampler call
(row j sees the context plus drafts 0..j-1), with the request's own sampling parameters and
generator. ``accept_run`` keeps the drafts while the target's token equals them, then the
target's token at the first disagreement (or after the last draft).

- Greedy: that is the longest matching prefix plus the target's next token, so the output
  is exactly the non-speculative greedy output.
- Temperature > 0 with a deterministic drafter (q = 1 on the proposed token d, n-gram
  drafts): rejection sampling accepts d with probability min(1, p(d) / q(d)) = p(d) and on
  rejection resamples from max(0, p - q) normalised, which is p with d removed. Sampling
  x ~ p and accepting when x == d does both at once: P(accept) = p(d), and a rejected x is
  distributed as p conditioned on x != d. The output distribution is exactly the target's.
  A draft model's samples (q not a point mass) go through ``rejection.rejection_sample``.
Torch-free.
"""
from __future__ import annotations

from typing import Sequence


def accept_run(drafts: Sequence[int], target: Sequence[int]) -> list[int]:
    """``target[j]``: the target's token at draft position j, ``target[len(drafts)]`` the one
    after all drafts. Returns the accepted drafts followed by one target token."""
    assert len(target) == len(drafts) + 1, (len(target), len(drafts))
    for j, draft in enumerate(drafts):
        if target[j] != draft:
            return list(target[:j + 1])
    return list(target)
