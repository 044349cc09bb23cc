"""Per-request timestamps and the summary every engine's run is reduced to.

All engines are timed the same way: ``start`` is when the request was handed to the engine
(or, for a sequential peer, when its turn began) and ``token_times`` are the moments each
output token became available to the caller, all on ``time.perf_counter``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


@dataclass
class RequestTiming:
    prompt_len: int
    start: float
    token_times: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    def add_tokens(self, token_ids: Sequence[int], now: float) -> None:
        self.output_token_ids.extend(int(t) for t in token_ids)
        self.token_times.extend([now] * len(token_ids))

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> Optional[float]:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e(self) -> Optional[float]:
        return self.token_times[-1] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def distribution(values_s: Sequence[Optional[float]]) -> dict:
    """mean / p50 / p90 / p99 / min / max in milliseconds (None entries dropped)."""
    vals = np.asarray([v for v in values_s if v is not None], dtype=np.float64) * 1e3
    if vals.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None,
                "count": 0}
    return {"mean": float(vals.mean()), "p50": float(np.percentile(vals, 50)),
            "p90": float(np.percentile(vals, 90)), "p99": float(np.percentile(vals, 99)),
            "min": float(vals.min()), "max": float(vals.max()), "count": int(vals.size)}


@dataclass
class EngineRun:
    """One engine's pass over one workload."""

    name: str
    requests: list[RequestTiming]
    started: float
    finished: float
    extra: dict = field(default_factory=dict)  # engine-specific figures (KV blocks, FLOPs...)

    @property
    def elapsed_s(self) -> float:
        return self.finished - self.started

    def summary(self) -> dict:
        n_out = sum(r.num_output_tokens for r in self.requests)
        n_prompt = sum(r.prompt_len for r in self.requests)
        elapsed = max(self.elapsed_s, 1e-9)
        return {
            "engine": self.name,
            "elapsed_s": self.elapsed_s,
            "num_requests": len(self.requests),
            "num_prompt_tokens": n_prompt,
            "num_output_tokens": n_out,
            "requests_per_s": len(self.requests) / elapsed,
            "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_out + n_prompt) / elapsed,
            "ttft_ms": distribution([r.ttft for r in self.requests]),
            "tpot_ms": distribution([r.tpot for r in self.requests]),
            "itl_ms": distribution([x for r in self.requests for x in r.itls]),
            "e2e_ms": distribution([r.e2e for r in self.requests]),
            **self.extra,
        }


def greedy_agreement(reference: EngineRun, other: EngineRun) -> float:
    """Mean fraction of each request's output that matches the reference before the first
    difference: a check that both engines did the same work, not a numerical test."""
    fractions = []
    for a, b in zip(reference.requests, other.requests):
        n = min(len(a.output_token_ids), len(b.output_token_ids))
        if n == 0:
            continue
        same = 0
        while same < n and a.output_token_ids[same] == b.output_token_ids[same]:
            same += 1
        fractions.append(same / n)
    return float(np.mean(fractions)) if fractions else 0.0
