"""Transfer counters of one instance, updated from the engine, loader and server threads and
read by /metrics. Torch-free."""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class LatencyHistogram:
    """Cumulative-bucket histogram in Prometheus' shape (counts per upper bound, sum, count)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += n
            out.append((bound, running))
        return out


class TransferStats:
    """Producer side: transfers published (and bytes staged), fetched, expired. Consumer side:
    transfers loaded (bytes, blocks, latency from start to the last block written), blocks a
    local prefix-cache hit spared, transfers failed (and so re-prefilled locally)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.published = 0
        self.published_bytes = 0
        self.fetched = 0
        self.sent_bytes = 0
        self.expired = 0
        self.loaded = 0
        self.received_bytes = 0
        self.received_blocks = 0
        self.reused_blocks = 0
        self.failed = 0
        self.load_latency = LatencyHistogram()
        self.publish_latency = LatencyHistogram()

    def on_published(self, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self.published += 1
            self.published_bytes += num_bytes
            self.publish_latency.observe(seconds)

    def on_fetched(self, num_bytes: int) -> None:
        with self._lock:
            self.fetched += 1
            self.sent_bytes += num_bytes

    def on_expired(self, num: int = 1) -> None:
        with self._lock:
            self.expired += num

    def on_loaded(self, num_bytes: int, num_blocks: int, num_reused: int, seconds: float) -> None:
        with self._lock:
            self.loaded += 1
            self.received_bytes += num_bytes
            self.received_blocks += num_blocks
            self.reused_blocks += num_reused
            self.load_latency.observe(seconds)

    def on_failed(self) -> None:
        with self._lock:
            self.failed += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "kv_transfers_published": self.published,
                "kv_transfer_published_bytes": self.published_bytes,
                "kv_transfers_fetched": self.fetched,
                "kv_transfer_sent_bytes": self.sent_bytes,
                "kv_transfers_expired": self.expired,
                "kv_transfers_loaded": self.loaded,
                "kv_transfer_received_bytes": self.received_bytes,
                "kv_transfer_received_blocks": self.received_blocks,
                "kv_transfer_reused_blocks": self.reused_blocks,
                "kv_transfers_failed": self.failed,
                "kv_transfer_load_seconds": (self.load_latency.cumulative(), self.load_latency.total,
                                             self.load_latency.count),
                "kv_transfer_publish_seconds": (self.publish_latency.cumulative(), self.publish_latency.total,
                                                self.publish_latency.count),
            }
