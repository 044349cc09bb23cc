"""How many bytes the KV pool gets: a fixed default, an explicit budget, or ``auto``.

``--kv-cache-memory auto`` (vLLM's ``gpu_memory_utilization`` for a host): after the weights
are loaded, the pool takes a fraction of the memory still free, less what the weights mapped
from the file need resident (page cache counts as available memory, but evicting the weights'
pages to grow the pool would turn every step into disk reads) and less one step's peak
activations (the workspace). The cap on useful blocks (``max_num_seqs`` full contexts) still
applies in the engine.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

AUTO = "auto"
# Of what is left after weights and workspace: the rest stays for the tokenizer, the server,
# allocator fragmentation and whatever else runs on the machine.
AUTO_UTILIZATION = 0.9
# Never size the pool into the last bytes of the machine.
AUTO_HEADROOM_BYTES = 512 << 20


@dataclass(frozen=True)
class KVBudget:
    """The pool's bytes and how they were chosen (the start-up line prints ``describe``)."""

    bytes: int
    rule: str  # "explicit", "default" or "auto"
    available: Optional[int] = None  # auto: memory free when sized
    mapped: int = 0  # auto: weight bytes read in place from the file
    workspace: int = 0  # auto: one step's activations, estimated
    num_pools: int = 1  # auto: the processes that each hold a pool of these bytes

    def describe(self) -> str:
        if self.rule != AUTO:
            return self.rule
        shared = f", shared by {self.num_pools} ranks" if self.num_pools > 1 else ""
        return (f"auto: {AUTO_UTILIZATION:.0%} of {self.available / 2**20:.0f} MiB available less "
                f"{self.mapped / 2**20:.0f} MiB mapped weights, {self.workspace / 2**20:.0f} MiB workspace "
                f"and {AUTO_HEADROOM_BYTES >> 20} MiB headroom{shared}")


def parse_kv_cache_memory(value: object) -> Optional[object]:
    """``None``, a positive byte count or ``"auto"``; anything else is a ValueError."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"kv_cache_memory must be a positive byte count or 'auto', got {value!r}")
    return value


def default_kv_cache_memory(device_free: Optional[int] = None) -> int:
    """A KV budget that leaves the rest of the machine alone: an eighth of available host
    memory capped at 1 GiB on CPU (46k tokens of SmolLM2 in bf16); half of a device's free
    memory (``device_free``, the caller's torch.cuda.mem_get_info) on CUDA."""
    if device_free is not None:
        return int(device_free * 0.5)
    return int(min(1 << 30, host_available_bytes() // 8))


def _cgroup_free_bytes() -> Optional[int]:
    """What the process's memory cgroup still allows (v2, then v1); None without a limit. The
    cgroup's usage counts page cache, which the kernel reclaims under its limit: the inactive
    file pages (memory.stat) are not taken as used (a model file read once while loading would
    otherwise count twice, as usage and as the mapped weights)."""
    for limit_file, usage_file, stat_file, inactive_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):
        try:
            limit = Path("/sys/fs/cgroup", limit_file).read_text().strip()
            usage = int(Path("/sys/fs/cgroup", usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # v1 says "no limit" with a huge number
            return max(0, int(limit) - usage + _stat_value(Path("/sys/fs/cgroup", stat_file), inactive_key))
    return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def host_available_bytes() -> int:
    """MemAvailable (free + reclaimable page cache), bounded by the memory cgroup's limit."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        try:
            import psutil
            available = psutil.virtual_memory().available
        except ImportError:
            available = 8 << 30
    cgroup = _cgroup_free_bytes()
    return available if cgroup is None else min(available, cgroup)


def step_workspace_bytes(hidden_size: int, intermediate_size: int, q_width: int, kv_width: int,
                         vocab_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak activations of one full step, in fp32: a chunk of ``max_num_batched_tokens`` holds
    the residual stream, the normed input and the attention output (3 x hidden), q, k and v,
    and the MLP's gate, up and product (3 x intermediate) at once; the sampled rows' logits
    twice over (logits and the sampler's probabilities)."""
    per_token = 3 * hidden_size + q_width + kv_width + 3 * intermediate_size
    return 4 * (max_num_batched_tokens * per_token + 2 * max_num_seqs * vocab_size)


def auto_kv_cache_memory(mapped_bytes: int, workspace_bytes: int, available: Optional[int] = None,
                         num_pools: int = 1) -> KVBudget:
    """The ``auto`` budget of one pool. ``available``: a device's free memory (its weights are
    allocations, already out of it: pass no mapped bytes), or the host's when None.
    ``num_pools``: the processes on this host that each allocate a pool of this size (ranks);
    ``workspace_bytes`` is one process's, ``mapped_bytes`` all of theirs."""
    if available is None:
        available = host_available_bytes()
    spare = available - mapped_bytes - num_pools * workspace_bytes - AUTO_HEADROOM_BYTES
    return KVBudget(int(max(0, spare) * AUTO_UTILIZATION) // num_pools, AUTO, available, mapped_bytes,
                    workspace_bytes, num_pools)
