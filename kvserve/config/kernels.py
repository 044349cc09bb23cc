"""``KernelConfig``: which CPU kernels and numerics an engine runs with.

These used to be environment switches read wherever a kernel needed them (and C++ globals set
from them), so two engines in one process could not differ and a run's configuration was not in
its config. Now they are one dataclass inside ``EngineArgs``; the engine resolves it once at
start-up against the CPU's features and the built kernels (``kvserve.ops.apply_kernel_config``)
and prints the result in its start-up line. Torch-free: a plain value that crosses to worker
processes with the rest of the engine's arguments.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from kvserve.errors import ConfigError

# bf16 linear layers and attention over a bf16 cache: "auto" takes the CPU's default (the tiles
# where AMX runs for the linears, the vendor's faster vector form otherwise); "dot" multiplies
# bf16 pairs (vdpbf16ps), "widened" widens bf16 to fp32 for FMAs, "amx" demands Intel's tiles
# (an error where they cannot run). The routes differ in speed and in the last bits.
KERNEL_ROUTES = ("auto", "dot", "widened", "amx")


@dataclass(frozen=True)
class KernelConfig:
    # The fused C++ kernels (kvserve/csrc). False runs the plain-torch reference path: slower,
    # and the ground truth the kernels are tested against.
    native_kernels: bool = True
    # The -march the kernels are compiled for ("native": this CPU). Another CPU's name (znver3,
    # x86-64-v2) builds that CPU's route here, to test it; it is fixed at a process's first build.
    cpu_march: str = "native"
    bf16_route: str = "auto"
    attention_route: str = "auto"
    # A decode step's OpenMP threads start once per step and wait for each kernel's work in a
    # spin slot (csrc/step_team.h), instead of one OpenMP region per kernel call.
    step_teams: bool = True
    # Every row's bits independent of the batch (kvserve's own linear kernels for fp32 and
    # bf16). False hands bf16 linears to oneDNN: faster prefill on some CPUs, rows that change
    # with the batch (the bench's kvserve-blas peer).
    batch_invariant: bool = True
    # Ranks on one machine exchange a step's small tensors through shared memory rather than
    # gloo's loopback TCP (kvserve/shm_collectives.py).
    shm_collectives: bool = True
    # Workers time their collectives (benchmarks/tensor_parallel.py reads the figures).
    time_collectives: bool = False

    def validate(self) -> None:
        for name in ("bf16_route", "attention_route"):
            if getattr(self, name) not in KERNEL_ROUTES:
                raise ConfigError(f"unknown {name} {getattr(self, name)!r}; use one of {', '.join(KERNEL_ROUTES)}")
        if not self.cpu_march or any(c.isspace() for c in self.cpu_march):
            raise ConfigError(f"cpu_march must be a compiler -march name, got {self.cpu_march!r}")

    def describe(self) -> str:
        """The start-up line's words for this configuration."""
        if not self.native_kernels:
            return "kernels: plain torch"
        march = "" if self.cpu_march == "native" else f" (-march={self.cpu_march})"
        return (f"kernels: native{march}, bf16 route {self.bf16_route}, attention route {self.attention_route}, "
                f"step teams {_on(self.step_teams)}, batch-invariant {_on(self.batch_invariant)}")


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def parse_kernel_config(value: Optional[Any]) -> KernelConfig:
    """A KernelConfig from itself, a dict of its fields, or None (the defaults)."""
    if value is None:
        config = KernelConfig()
    elif isinstance(value, KernelConfig):
        config = value
    elif isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(KernelConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown kernel_config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        config = KernelConfig(**value)
    else:
        raise ConfigError(f"kernel_config must be a KernelConfig or a dict, got {type(value).__name__}")
    config.validate()
    return config
