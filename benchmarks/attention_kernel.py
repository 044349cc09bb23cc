"""The fused paged-attention kernel alone, at a model's shapes (its layers, KV heads, query heads
per KV head and head dimension; a bf16 cache in blocks of 16 on huge pages, a sequence's blocks
consecutive as the engine's allocator hands them out): a prefill of ``--prompt`` tokens through
every layer, and a decode step at ``--context`` keys through every layer, warm (the cache still
in L2/L3 from the last step) and cold (a 64 MB sweep between steps, as a decode step's weights
evict it). Prints the CPU and the kernel's route for a bf16 cache (dot | widened | amx;
`--routes` picks others); best medians of ``--repeats`` rounds. ``--routes`` runs
several routes in this one process, alternated round by round (on an AMX machine:
``--routes widened,amx``; ``amx-emulated`` is the tile program's C++ model, for checks, not speed).
``--batch N``: the decode step is N sequences' (each on its own blocks), as in a batched step;
past N = 4 or so their keys and values outgrow L3, and warm reads come from memory too.

    python benchmarks/attention_kernel.py [--model gemma-3-270m] [--prompt 256] [--context 320]
        [--batch 32] [--routes widened,amx]
"""
from __future__ import annotations

import argparse
import time

import torch

from kvserve import ops
from kvserve.bench.machine import cpu_info
from kvserve.kv_cache import SCALE_DTYPE, int8_group_size
from kvserve.loader import load_config
from kvserve.loader.resolve import resolve_model

BLOCK = 16


def _median_ms(fn, iterations: int, before=None) -> float:
    times = []
    for _ in range(iterations):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--batch", type=int, default=1, help="sequences in the decode step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--routes", default="", help="comma-separated attention routes (default: this process's)")
    ap.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "int8"],
                    help="int8: the quantized cache's own tile (the routes are the bf16 cache's)")
    args = ap.parse_args()
    ext = ops.load_extension()
    if ext is None:
        raise SystemExit("the fused CPU kernels are not built")
    routes = [r for r in args.routes.split(",") if r] or [ext.attention_kernel_route()]
    cfg = load_config(resolve_model(args.model))
    layers, kv_heads, heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} ({', '.join(cpu['features'])}), {torch.get_num_threads()} threads; "
          f"routes {', '.join(routes)}")
    print(f"{args.model}: {layers} layers, {heads} query heads on {kv_heads} KV heads of {dim}; "
          f"{args.kv_cache_dtype} cache")

    torch.manual_seed(0)
    longest = max(args.prompt, args.context)
    blocks_per_sequence = -(-longest // BLOCK)
    num_blocks = args.batch * blocks_per_sequence + 1  # (block 0 unused)
    caches, scales = [], []
    int8 = args.kv_cache_dtype == "int8"
    for _ in range(layers):
        shape = (2, kv_heads, num_blocks, BLOCK, dim)
        cache = ops.empty_huge_pages(shape, torch.int8 if int8 else torch.bfloat16, "cpu")
        if int8:  # random codes and scales: the kernel's work does not depend on the values
            cache.copy_(torch.randint(-127, 128, shape, dtype=torch.int8))
            groups = dim // int8_group_size(dim)
            scales.append((torch.rand(2, kv_heads, num_blocks, groups, BLOCK) * 0.02).to(SCALE_DTYPE))
        else:
            cache.copy_(torch.randn(shape))
            scales.append(None)
        caches.append(cache)
    tables = torch.arange(1, num_blocks, dtype=torch.int32).reshape(args.batch, blocks_per_sequence)
    scale = dim ** -0.5

    def through_layers(queries: int, keys: int, sequences: int = 1):
        """Each of `sequences` sequences: `queries` queries, the last at position keys - 1."""
        rows = queries * sequences
        q, out = torch.randn(rows, heads, dim), torch.empty(rows, heads, dim)
        seq_lens = torch.full((sequences,), keys, dtype=torch.int32)
        query_lens = torch.full((sequences,), queries, dtype=torch.int64)
        seq_ids, starts = torch.arange(sequences), torch.arange(sequences) * queries
        table = tables[:sequences]

        def run():
            for cache, cache_scales in zip(caches, scales):
                ext.paged_attention(out, q, cache, cache_scales, table, seq_lens, seq_ids, starts, query_lens, scale, 0,
                                    0.0)
        return run

    prefill, decode = through_layers(args.prompt, args.prompt), through_layers(1, args.context, args.batch)
    sweep = torch.empty(64 << 20, dtype=torch.uint8)
    results = {route: {"prefill": [], "decode warm": [], "decode cold": []} for route in routes}
    for _ in range(args.repeats):
        for route in routes:
            ext.set_attention_kernel_route(route)
            results[route]["prefill"].append(_median_ms(prefill, 9))
            results[route]["decode warm"].append(_median_ms(decode, 41))
            results[route]["decode cold"].append(_median_ms(decode, 41, before=lambda: sweep.add_(1)))
    kv_mb = args.batch * layers * 2 * kv_heads * args.context * dim * (1 if int8 else 2) / 1e6
    sequences = "" if args.batch == 1 else f" x {args.batch} sequences"
    # The machine's plain read rate in this process, the reference for the GB/s below.
    sweep_floats = sweep.view(torch.float32)
    read_ms = min(_median_ms(sweep_floats.sum, 9) for _ in range(args.repeats))
    print(f"plain read of {sweep.numel() >> 20} MB (torch sum): {sweep.numel() / 1e6 / read_ms:.1f} GB/s")
    for route in routes:
        print(f"route {route}:")
        print(f"  prefill of {args.prompt} tokens   {min(results[route]['prefill']):8.2f} ms through {layers} layers")
        for kind in ("decode warm", "decode cold"):
            ms = min(results[route][kind])
            print(f"  {kind} at {args.context} keys{sequences} {ms:8.3f} ms through {layers} layers "
                  f"({kv_mb:.1f} MB of keys and values, {kv_mb / ms:.1f} GB/s)")


if __name__ == "__main__":
    main()
