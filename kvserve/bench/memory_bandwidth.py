"""The machine's read bandwidth, measured in the same run as the figures it is set against.

Decode at batch 1 is bound by the bytes it reads (weights and KV cache) per token; how close
an engine comes to the memory's limit is bytes per token / TPOT against what a plain large
read reaches on the same cores at the same moment. The read is ``torch.sum`` over an fp32
buffer many times the last-level cache: one pass streams every byte from memory, and a sum
costs one add per 4 bytes, far below what the cores can do, so the memory sets the pace.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

# 512 MiB: ten times the largest last-level cache of the machines these benchmarks run on
# (48 MiB on the Ice Lake Xeons, 32 MiB on the Zen parts), so nothing of it stays cached.
DEFAULT_BUFFER_BYTES = 512 * 2**20
DEFAULT_REPEATS = 5


@dataclass(frozen=True)
class ReadBandwidth:
    """Best of ``repeats`` full reads of a ``buffer_bytes`` buffer at ``num_threads``."""

    gbs: float  # 1e9 bytes per second
    buffer_bytes: int
    repeats: int
    num_threads: int
    method: str = "torch.sum over an fp32 buffer"

    def to_dict(self) -> dict:
        return asdict(self)


def measure_read_bandwidth(buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                           repeats: int = DEFAULT_REPEATS) -> ReadBandwidth:
    """Best of ``repeats`` timed sums (best, not mean: other work on a shared machine only
    ever slows a pass down). The buffer is written once first, so every page is backed."""
    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    buffer.sum()  # page-faults and thread-pool start-up stay out of the timing
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - t0)
    nbytes = buffer.numel() * buffer.element_size()
    del buffer
    return ReadBandwidth(gbs=nbytes / best / 1e9, buffer_bytes=nbytes, repeats=max(1, repeats),
                         num_threads=torch.get_num_threads())
