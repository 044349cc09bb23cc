"""A prefill instance's published transfers, waiting for their decode side. Torch-free.

A transfer is staged (its KV copied out of the pool, whose blocks are freed at once) until a
decode side takes it, the decode side says it does not need it, or it expires: the staged
bytes are bounded by a TTL and a capacity, never by a decode side's good behaviour.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass
class StagedTransfer:
    transfer_id: str
    num_bytes: int
    # Frees the storage (unlinks a shared-memory file, drops a buffer); called once.
    release: Callable[[], None]
    # Whether a decode side already consumed it by itself (a shared-memory file it unlinked).
    consumed: Callable[[], bool] = lambda: False
    payload: object = None  # the connector's handle on the bytes (a buffer), if it keeps one
    manifest: object = None
    created: float = field(default_factory=time.monotonic)


class StagingArea:
    def __init__(self, ttl_s: float, capacity_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._staged: "OrderedDict[str, StagedTransfer]" = OrderedDict()
        self._bytes = 0

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    @property
    def staged_bytes(self) -> int:
        return self._bytes

    def add(self, entry: StagedTransfer) -> list[StagedTransfer]:
        """Stage ``entry``; returns the oldest transfers evicted to keep within capacity
        (already released)."""
        evicted = []
        with self._lock:
            self._staged[entry.transfer_id] = entry
            self._bytes += entry.num_bytes
            while self._bytes > self.capacity_bytes and len(self._staged) > 1:
                _, old = self._staged.popitem(last=False)
                self._bytes -= old.num_bytes
                evicted.append(old)
        for old in evicted:
            old.release()
        return evicted

    def take(self, transfer_id: str) -> Optional[StagedTransfer]:
        """Remove and return a staged transfer (the caller releases it when done reading)."""
        with self._lock:
            entry = self._staged.pop(transfer_id, None)
            if entry is not None:
                self._bytes -= entry.num_bytes
            return entry

    def discard(self, transfer_id: str) -> bool:
        entry = self.take(transfer_id)
        if entry is not None:
            entry.release()
        return entry is not None

    def sweep(self, now: Optional[float] = None) -> tuple[int, int]:
        """Drop what a decode side consumed by itself and what expired: (consumed, expired)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [e for e in self._staged.values() if e.consumed() or now - e.created > self.ttl_s]
            for e in gone:
                del self._staged[e.transfer_id]
                self._bytes -= e.num_bytes
        consumed = 0
        for e in gone:
            if e.consumed():
                consumed += 1
            e.release()
        return consumed, len(gone) - consumed

    def clear(self) -> None:
        with self._lock:
            entries = list(self._staged.values())
            self._staged.clear()
            self._bytes = 0
        for e in entries:
            e.release()
