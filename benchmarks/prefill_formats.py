"""int4 mode's prompt rows, layer by layer: through the layer's own blocks (the 4-bit tiles,
Q5_0, Q8_0/Q6_K kernels), through its bf16 copy or through an int8 copy under int8 activations
(``--int4-prefill int8``, W8A8Linear: the blocks' byte codes; a bf16 copy for Q6_K, marked),
at one prompt length, on this CPU. It is
the measurement behind ``--int4-prefill auto`` (``DecodeFormatLinear.prefill_copy_pays``):
the table says, per layer kind, which way is faster here and what ``auto`` chose, and the
totals over the decoder's linear layers compare all blocks, all copies, ``auto`` and the
per-kind best. Calls alternate between the three ways, each first in turn; each figure is the minimum of
``--repeats`` calls (the machine is shared and noisy: only the ratios mean much).

    python benchmarks/prefill_formats.py [--model gemma-3-270m] [--rows 256] [--repeats 7]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from kvserve.bench.machine import cpu_info
from kvserve.loader import load_model
from kvserve.loader.resolve import resolve_model
from kvserve.quant import DecodeFormatLinear, W8A8Linear


def _min_ms(fn, x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _kind(name: str, layer: DecodeFormatLinear) -> str:
    parts = getattr(layer, "segments", None)
    fmt = type(layer).__name__
    if parts is not None:
        fmt += "(" + ",".join(type(p).__name__ for p in parts) + ")"
    return f"{name.split('.')[-1]} {layer.out_features}x{layer.in_features} {fmt}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} ({', '.join(cpu['features'])}), {torch.get_num_threads()} threads")
    model, _ = load_model(resolve_model(args.model), dtype=torch.bfloat16, quantization="int4",
                          int4_prefill="bf16")
    layers = [(n, m) for n, m in model.named_modules()
              if isinstance(m, DecodeFormatLinear) and m.prefill is not None and ".layers." in n]
    per_kind: dict[str, list[tuple[float, float, bool, float]]] = defaultdict(list)
    with torch.inference_mode():
        for name, layer in layers:
            x = torch.randn(args.rows, layer.in_features, dtype=torch.bfloat16)
            int8_copy = layer.make_prefill_copy("int8")  # (a Bf16Linear where the format has no byte codes)
            ways = [layer.forward_blocks, layer.prefill, int8_copy]
            for way in ways:
                way(x)  # warm: page in, pack caches
            best = [float("inf")] * 3
            for repeat in range(args.repeats):
                for i in range(3):  # each way first in turn (what runs after what moves the figures)
                    way = (repeat + i) % 3
                    best[way] = min(best[way], _min_ms(ways[way], x, 1))
            blocks, copy, int8 = best
            per_kind[_kind(name, layer) + ("" if isinstance(int8_copy, W8A8Linear) else " (int8: bf16 copy)")].append(
                (blocks, copy, layer.prefill_copy_pays(), int8))
    print(f"\n{args.model}, int4, {args.rows} prompt rows per call, min of {args.repeats} alternated calls\n")
    print("| layer kind | layers | blocks ms | bf16 copy ms | blocks / copy | auto keeps the copy | int8 copy ms | bf16 / int8 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    totals = defaultdict(float)
    for kind, rows in per_kind.items():
        blocks, copy, int8 = sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[3] for r in rows)
        keeps = {r[2] for r in rows}
        totals["blocks"] += blocks
        totals["copies"] += copy
        totals["auto"] += sum(r[1] if r[2] else r[0] for r in rows)
        totals["best per kind"] += min(blocks, copy)
        totals["int8 copies"] += int8
        print(f"| {kind} | {len(rows)} | {blocks:.1f} | {copy:.1f} | {blocks / copy:.2f} | "
              f"{'yes' if keeps == {True} else 'no' if keeps == {False} else 'mixed'} | {int8:.1f} | {copy / int8:.2f} |")
    print("\nDecoder linear layers in all:", ", ".join(f"{k} {v:.1f} ms" for k, v in totals.items()))


if __name__ == "__main__":
    main()
