"""Decode step time over long contexts, int8 against bf16 KV (issue 64's speed bar): ``--batch``
requests (8) at ``--context`` tokens (3,000) each, one decode step of every request, through the
model as the engine runs it (fused decoder, fp32 weights unless ``--quantization``). The caches
are filled with random keys and values through the write path (the step's work does not depend
on their values, and a prefill of 24,000 tokens would take minutes here). The two caches'
steps alternate (bf16, int8, bf16, ...) so that both see the same machine load; prints the
median step of each and their ratio, and the CPU.

    python benchmarks/int8_kv_decode.py [--model gemma-3-270m] [--context 3000] [--batch 8]
        [--steps 15] [--quantization gguf] [--cpu-time]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.attention import build_attention_metadata
from kvserve.bench.machine import cpu_info
from kvserve.kv_cache import KVCache, allocate_kv_cache
from kvserve.loader import load_model, resolve_model

BLOCK = 16


def filled_cache(config, tables: list[list[int]], context: int, dtype: str) -> KVCache:
    num_blocks = sum(len(t) for t in tables)
    kv = allocate_kv_cache(config, num_blocks, BLOCK, dtype, "cpu")
    md = build_attention_metadata(tables, [0] * len(tables), [context] * len(tables), BLOCK)
    generator = torch.Generator().manual_seed(0)
    for layer in kv.layers:
        shape = (len(tables) * context, layer.num_kv_heads, layer.head_dim)
        layer.write(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator),
                    md.for_group(layer.group).slot_mapping)
    return kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--dtypes", default="bfloat16,int8")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by its CPU time: a ratio that holds on a machine other work loads")
    args = parser.parse_args()
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    print(f"CPU: {cpu_info()}")
    model, config = load_model(resolve_model(args.model), dtype=torch.float32, quantization=args.quantization)
    blocks_per_seq = -(-(args.context + args.steps) // BLOCK)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(args.batch)]
    dtypes = args.dtypes.split(",")
    caches = {d: filled_cache(config, tables, args.context, d) for d in dtypes}
    times: dict[str, list[float]] = {d: [] for d in dtypes}
    tokens = torch.randint(1000, 2000, (args.batch,), generator=torch.Generator().manual_seed(1))
    rows = torch.arange(args.batch)
    with torch.inference_mode():
        for step in range(args.steps + 1):  # the first step of each warms up, not counted
            position = args.context + step
            md = build_attention_metadata(tables, [position] * args.batch, [1] * args.batch, BLOCK)
            for dtype in dtypes:
                t0 = clock()
                model(tokens, torch.full((args.batch,), position), md, caches[dtype], rows)
                if step > 0:
                    times[dtype].append(clock() - t0)
    medians = {d: statistics.median(t) * 1e3 for d, t in times.items()}
    print(f"{args.model}, {args.batch} requests at {args.context} tokens, weights "
          f"{args.quantization or 'fp32'}: median decode step over {args.steps} steps"
          + (" (one thread's CPU time)" if args.cpu_time else ""))
    for dtype in dtypes:
        print(f"  {dtype}: {medians[dtype]:.1f} ms ({medians[dtype] / medians[dtypes[0]]:.3f}x {dtypes[0]})")


if __name__ == "__main__":
    main()
