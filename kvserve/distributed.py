"""The collectives a sharded model calls, over one torch.distributed process group.

``ParallelGroup`` is passed explicitly to the modules that communicate (no global state): a
tensor-parallel rank's attention and MLP all-reduce their row-parallel outputs, its embedding
all-reduces the looked-up rows, its LM head all-gathers the vocabulary shards. Backends: gloo
on CPU, NCCL on CUDA (``backend_for``).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass
class ParallelGroup:
    """This process's place in a group of ``world_size`` ranks (``group`` None: the default
    group). A group of one does no communication."""

    rank: int
    world_size: int
    group: Optional[Any] = None
    # Accumulated seconds spent in collectives (the all-reduce measurement reads it).
    comm_time_s: float = 0.0
    time_comm: bool = False

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place where the dtype allows; every rank gets the same
        result (gloo reduces each chunk on one rank and broadcasts it)."""
        if self.world_size == 1:
            return x
        t0 = _now() if self.time_comm else 0.0
        if x.dtype in (torch.float32, torch.float64) or x.is_cuda:
            dist.all_reduce(x, group=self.group)
            out = x
        else:  # gloo reduces no bf16/fp16: sum in fp32
            wide = x.float()
            dist.all_reduce(wide, group=self.group)
            out = wide.to(x.dtype)
        if self.time_comm:
            self.comm_time_s += _now() - t0
        return out

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        t0 = _now() if self.time_comm else 0.0
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        if self.time_comm:
            self.comm_time_s += _now() - t0
        return torch.cat(parts, dim=-1)


def _now() -> float:
    import time
    return time.perf_counter()


def init_process_group(rank: int, world_size: int, init_method: str, device: torch.device | str,
                       timeout_s: float) -> ParallelGroup:
    """Join the default group. ``timeout_s`` bounds every collective: a peer that hangs makes
    the others fail after it instead of blocking for ever."""
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelGroup(rank=rank, world_size=world_size, group=None,
                         time_comm=os.environ.get("KVSERVE_TIME_COMM") == "1")
