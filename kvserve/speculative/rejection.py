"""Rejection sampling for a model drafter at temperature > 0 (Leviathan et al., Chen et al.).

Draft ``d_j`` was sampled from the draft's processed distribution ``q_j``; the target's
processed distribution at the same position is ``p_j`` (the same temperature, top-k, top-p,
min-p and logit bias). Accept ``d_j`` with probability min(1, p_j(d_j) / q_j(d_j)); at the
first rejection sample the replacement from max(0, p_j - q_j) normalised and stop; when every
draft is accepted sample one more token from ``p_k``. Whatever ``q`` is, every emitted token
is distributed exactly as the target's: P(x) = min(p, q)(x) + (1 - sum min(p, q)) *
(p - q)+(x) / sum (p - q)+ = p(x).

All randomness of a request comes from its own generator (or the device's default one when
it has none), in a fixed order (k uniforms, then one exponential race over the vocabulary),
so a seeded request is reproducible.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvserve.sampler import exponential_race


def rejection_sample(drafts: Sequence[int], target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     generator: Optional[torch.Generator] = None) -> list[int]:
    """``target_probs [k+1, V]``, ``draft_probs [k, V]`` (rows need not be normalised).
    Returns the accepted drafts followed by one token sampled as described above."""
    k = len(drafts)
    assert target_probs.shape[0] == k + 1 and draft_probs.shape[0] == k, (target_probs.shape, draft_probs.shape)
    p = target_probs.float()
    p = p / p.sum(dim=-1, keepdim=True)
    q = draft_probs.float()
    q = q / q.sum(dim=-1, keepdim=True)
    rows = torch.arange(k, device=p.device)
    ids = torch.tensor(list(drafts), dtype=torch.int64, device=p.device)
    p_d, q_d = p[rows, ids], q[rows, ids]
    uniform = torch.rand(k, generator=generator, device=p.device)
    # u < p / q without the division; q_d > 0 since d was drawn from q.
    rejected = (uniform * q_d >= p_d).tolist()
    generators = {0: generator} if generator is not None else {}
    for j, reject in enumerate(rejected):
        if reject:
            residual = (p[j] - q[j]).clamp_(min=0.0)
            if not bool(residual.sum() > 0):  # p == q up to rounding: cannot happen in exact arithmetic
                residual = p[j]
            token = int(exponential_race(residual.unsqueeze(0), generators)[0])
            return list(drafts[:j]) + [token]
    return list(drafts) + [int(exponential_race(p[k:k + 1], generators)[0])]
