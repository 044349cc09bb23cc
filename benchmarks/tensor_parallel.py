"""Tensor parallelism on one CPU box: what the collectives cost.

1. gloo all-reduce between local ranks over TCP (loopback), per call, for the shapes a decode
   step reduces (rows x hidden of SmolLM2: 576 fp32).
   Beside it, kvserve's shared-memory all-reduce (kvserve/shm_collectives.py).
2. In a TP engine: time in collectives per decode step against the step time, read from the
   workers (``KernelConfig(time_collectives=True)``), for a single stream (W3 shape) and a
   batch (W2 shape); with ``--gloo`` (``KernelConfig(shm_collectives=False)``) the engine's
   collectives are gloo's.

Run under the heavy-run lock, one thread per rank:
    flock /tmp/kvserve-heavy.lock python benchmarks/tensor_parallel.py [--tp 2] [--output-len 64]
"""
from __future__ import annotations

import argparse
import os
import time


def _allreduce_rank(rank: int, world: int, port: int, shapes: list, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    from kvserve.distributed import init_process_group

    torch.set_num_threads(1)
    # The group kvserve's workers use: shared-memory collectives, gloo beside them.
    tp, _ = init_process_group(rank, world, f"tcp://127.0.0.1:{port}", "cpu", 60.0,
                               shm_path=f"/dev/shm/kvserve-bench-{port}")
    results = {}
    for kind in ("gloo", "shm"):
        for shape in shapes:
            x = torch.randn(*shape)
            op = dist.all_reduce if kind == "gloo" else tp.shm.all_reduce_
            for _ in range(20):
                op(x)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                op(x)
            results[f"{kind} {shape}"] = (time.perf_counter() - t0) / iters
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def allreduce_costs(world: int, shapes: list, iters: int = 2000) -> dict:
    import multiprocessing as mp

    from kvserve.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, shapes, iters, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=30)
    return res


def engine_comm(tp: int, model: str, num_requests: int, prompt_len: int, output_len: int, shm: bool) -> dict:
    from kvserve import SamplingParams
    from kvserve.config import KernelConfig
    from kvserve.llm import LLM

    kernels = KernelConfig(time_collectives=True, shm_collectives=shm)
    llm = LLM(model=model, tensor_parallel_size=tp, num_threads=1, kv_cache_memory=256 << 20, kernel_config=kernels)
    try:
        prompts = [[1000 + (i * 37 + j) % 20000 for j in range(prompt_len)] for i in range(num_requests)]
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        before = llm.engine.executor.worker_stats()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        after = llm.engine.executor.worker_stats()
    finally:
        llm.engine.shutdown()
    steps = after[0]["steps"] - before[0]["steps"]
    comm = [(a["comm_time_s"] - b["comm_time_s"]) / steps for a, b in zip(after, before)]
    step = [(a["step_time_s"] - b["step_time_s"]) / steps for a, b in zip(after, before)]
    return {"steps": steps, "wall_s": wall, "step_ms": [s * 1e3 for s in step],
            "comm_ms": [c * 1e3 for c in comm], "comm_fraction": [c / s for c, s in zip(comm, step)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default="gemma-3-270m", help="TP=2 needs even head counts (SmolLM2: 9 / 3)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--gloo", action="store_true", help="the engine's collectives over gloo, not shared memory")
    ns = parser.parse_args()
    import platform
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"cpu: {cpu}, {os.cpu_count()} cores")
    shapes = [(1, 576), (32, 576), (256, 576)]  # SmolLM2 hidden size; TP=2 engines need even heads (Gemma 3: 4 / 1)
    for shape, t in allreduce_costs(ns.tp, shapes).items():
        print(f"all_reduce over {ns.tp} local ranks, {shape} fp32: {t * 1e6:.0f} us per call")
    for name, (n, p) in {"W3-shape (1 x 256 prompt)": (1, 256), "W2-shape (32 x 64 prompt)": (32, 64)}.items():
        r = engine_comm(ns.tp, ns.model, n, p, ns.output_len, shm=not ns.gloo)
        backend = "gloo" if ns.gloo else "shm"
        print(f"TP={ns.tp} ({backend}) {ns.model} {name}, {ns.output_len} out: {r['steps']} steps, "
              f"step {', '.join(f'{s:.1f}' for s in r['step_ms'])} ms per rank, "
              f"collectives {', '.join(f'{c:.2f}' for c in r['comm_ms'])} ms "
              f"({', '.join(f'{f:.0%}' for f in r['comm_fraction'])})")


if __name__ == "__main__":
    main()
