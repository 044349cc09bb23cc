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


# Largest tensor (bytes per rank) the shared-memory collectives take; larger ones use gloo.
SHM_SLOT_BYTES = 8 << 20


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
    # Ranks on one machine: small collectives through shared memory instead of gloo.
    shm: Optional[Any] = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place where the dtype allows; every rank gets the same
        result (gloo reduces each chunk on one rank and broadcasts it)."""
        if self.world_size == 1:
            return x
        t0 = _now() if self.time_comm else 0.0
        if self.shm is not None and self.shm.fits(x):
            out = self.shm.all_reduce_(x)
        elif x.dtype in (torch.float32, torch.float64) or x.is_cuda:
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
        if self.shm is not None and self.shm.fits(x):
            out = self.shm.all_gather_last_dim(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.group)
            out = torch.cat(parts, dim=-1)
        if self.time_comm:
            self.comm_time_s += _now() - t0
        return out


def _now() -> float:
    import time
    return time.perf_counter()


@dataclass
class PipelineStage:
    """This rank's stage of the layer stack: it receives the hidden states from the same
    tensor-parallel rank of the previous stage and sends its own to the next one."""

    stage: int
    num_stages: int
    prev_rank: Optional[int]
    next_rank: Optional[int]
    layer_range: tuple[int, int] = (0, 0)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def send(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), self.next_rank)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device | str) -> torch.Tensor:
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(hidden, self.prev_rank)
        return hidden


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """Layers [start, end) of ``stage``: an even split, the first stages one more when the
    layers do not divide."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def init_process_group(rank: int, world_size: int, init_method: str, device: torch.device | str,
                       timeout_s: float, tp_size: Optional[int] = None, pp_size: int = 1,
                       shm_path: Optional[str] = None, time_comm: bool = False
                       ) -> tuple[ParallelGroup, Optional[PipelineStage]]:
    """Join the default group, then this rank's tensor-parallel group (ranks
    ``stage * tp_size + t``) and pipeline stage. ``timeout_s`` bounds every collective: a peer
    that hangs makes the others fail after it instead of blocking for ever. ``shm_path``
    (ranks on one machine): a /dev/shm path prefix for shared-memory collectives (None: gloo's
    own); ``time_comm``: the group times its collectives (KernelConfig.time_collectives)."""
    tp_size = tp_size or world_size
    if tp_size * pp_size != world_size:
        raise ValueError(f"{world_size} ranks are not {tp_size} x {pp_size}")
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    stage, tp_rank = divmod(rank, tp_size)
    group = None
    if pp_size > 1:
        # Every rank creates every group, in the same order (torch.distributed's rule).
        groups = [dist.new_group([s * tp_size + t for t in range(tp_size)]) for s in range(pp_size)]
        group = groups[stage]
    tp = ParallelGroup(rank=tp_rank, world_size=tp_size, group=group,
                       time_comm=time_comm)
    if shm_path and tp_size > 1 and torch.device(device).type == "cpu":
        from kvserve.shm_collectives import ShmCollectives
        path = f"{shm_path}-stage{stage}"
        if tp_rank == 0:
            tp.shm = ShmCollectives(path, tp_rank, tp_size, SHM_SLOT_BYTES, timeout_s, create=True)
        dist.barrier()
        if tp_rank != 0:
            tp.shm = ShmCollectives(path, tp_rank, tp_size, SHM_SLOT_BYTES, timeout_s, create=False)
        dist.barrier()
        if tp_rank == 0:
            os.unlink(path)  # the mappings stay; nothing is left in /dev/shm whatever happens next
    pp = None
    if pp_size > 1:
        pp = PipelineStage(stage=stage, num_stages=pp_size,
                           prev_rank=rank - tp_size if stage > 0 else None,
                           next_rank=rank + tp_size if stage < pp_size - 1 else None)
    return tp, pp
