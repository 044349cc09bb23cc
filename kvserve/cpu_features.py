"""What the CPU can do: its model name and the vector and matrix features kvserve's kernels
choose between. The lowest floor of the package (no kvserve imports), read by the kernel
configuration, the extension's loader and the benchmarks' reports alike."""
from __future__ import annotations

import platform

# The vector and matrix features kvserve's kernels choose between (and llama.cpp's builds).
CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                "amx_tile", "amx_bf16", "amx_int8")


def cpu_info() -> dict:
    """The CPU model and which of CPU_FEATURES it has, from /proc/cpuinfo (Linux; elsewhere
    the platform's processor string and no features)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"model": model, "features": [f for f in CPU_FEATURES if f in flags]}


def has_feature(name: str) -> bool:
    """Whether the CPU lists ``name`` (one of CPU_FEATURES)."""
    return name in cpu_info()["features"]
