"""Where a soak's memory goes: soak.py's mix against an in-process server; after each round
RSS, glibc's mallinfo2 (bytes in use, free inside the arenas, mmapped) and the Python object
types whose counts grew; after the last round the same after malloc_trim(0). In use flat
and free growing is the allocator (fragmentation); in use growing is a leak, and the
grown types say of what.

    python benchmarks/soak_diagnose.py [--model smollm2-135m-instruct] [--rounds 4] [--requests 120]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import soak  # noqa: E402
from test_server import ServerThread  # noqa: E402

from kvserve.async_engine import AsyncLLMEngine  # noqa: E402
from kvserve.config import EngineArgs  # noqa: E402
from kvserve.engine import LLMEngine  # noqa: E402
from kvserve.server.app import create_app  # noqa: E402


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_line(libc) -> str:
    m, mib = libc.mallinfo2(), 1 << 20
    return (f"malloc: arenas {m.arena / mib:.0f} MiB, in use {m.uordblks / mib:.0f}, "
            f"free in arenas {m.fordblks / mib:.0f}, mmapped {m.hblkhd / mib:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    libc = ctypes.CDLL("libc.so.6")  # glibc only
    libc.mallinfo2.restype = MallInfo2
    engine = LLMEngine(EngineArgs(model=args.model, kv_cache_memory=24 << 20, max_model_len=1024))
    async_engine = AsyncLLMEngine(engine)
    with ServerThread(create_app(async_engine, args.model)) as server:
        before = collections.Counter(type(o).__name__ for o in gc.get_objects())
        print(f"idle: RSS {soak.rss_mib(os.getpid()):,.0f} MiB; {malloc_line(libc)}", flush=True)
        for r in range(1, args.rounds + 1):
            t0 = time.monotonic()
            codes = asyncio.run(soak.run_round(server.url, r, args.requests, args.concurrency))
            time.sleep(2)
            gc.collect()
            now = collections.Counter(type(o).__name__ for o in gc.get_objects())
            grown = sorted(((now[k] - before.get(k, 0), k) for k in now), reverse=True)[:6]
            before = now
            print(f"round {r}: RSS {soak.rss_mib(os.getpid()):,.0f} MiB; {malloc_line(libc)}; "
                  f"blocks held {engine.kv_manager.num_used_blocks}; statuses "
                  f"{dict(sorted(codes.items()))}; {time.monotonic() - t0:.0f} s", flush=True)
            print(f"  grown object types: {grown}", flush=True)
        libc.malloc_trim(0)
        print(f"after malloc_trim(0): RSS {soak.rss_mib(os.getpid()):,.0f} MiB; {malloc_line(libc)}")
    async_engine.shutdown()


if __name__ == "__main__":
    main()
