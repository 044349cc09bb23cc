"""The bf16 linear kernel's routes side by side, on the decoder shapes of a model, at decode
and prefill row counts: this CPU's own route (AMX tiles where the machine has them, else
vdpbf16ps or the widened FMAs), every other route this build can take, and torch's bf16
matmul (oneDNN: fast, not batch invariant) as the yardstick. Calls alternate between the
routes; each figure is the minimum of ``--repeats`` passes over the layer shapes (the
machine is shared and noisy: compare within one run). A route's bits differ from the others',
so an engine keeps one for the process; this is how to see which one a machine should take.

    python benchmarks/bf16_routes.py [--model gemma-3-270m] [--rows 1,32,256] [--repeats 7]
"""
from __future__ import annotations

import argparse
import time

import torch

from kvserve import ops
from kvserve.bench.machine import cpu_info
from kvserve.loader import load_config
from kvserve.loader.resolve import resolve_model
from kvserve.quant import Bf16Linear


def layer_shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one decoder layer's projections."""
    cfg = load_config(resolve_model(model))
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * cfg.intermediate_size, h),
            ("down", h, cfg.intermediate_size)]


def routes_here(ext) -> list[str]:
    own = ext.bf16_kernel_route()
    routes = [own]
    for other in ("amx", "dot", "widened512"):
        if other == own:
            continue
        try:
            ext.set_bf16_kernel_route(other)
            routes.append(other)
        except RuntimeError:
            pass
    ext.set_bf16_kernel_route(own)
    return routes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,32,256")
    ap.add_argument("--repeats", type=int, default=7)
    ns = ap.parse_args()
    ext = ops.load_extension()
    if ext is None:
        raise SystemExit("kvserve's CPU kernels are not built here")
    own = ext.bf16_kernel_route()
    routes = routes_here(ext)
    shapes = layer_shapes(ns.model)
    torch.manual_seed(0)
    layers = [(name, Bf16Linear(torch.randn(n, k) * 0.05, None), torch.randn(n, k).bfloat16()) for name, n, k in shapes]
    cpu = cpu_info()
    print(f"{ns.model}, {torch.get_num_threads()} threads, {cpu['model']} [{' '.join(cpu['features'])}]; "
          f"this process's route: {own} (AMX: {ext.amx_bf16_status()})")
    print(f"{'rows':>5}  {'way':<16} {'ms per layer':>12} {'G mult-adds/s':>14}  per projection (ms)")
    try:
        for rows in (int(r) for r in ns.rows.split(",")):
            xs = [torch.randn(rows, layer.in_features) for _, layer, _ in layers]
            macs = sum(rows * layer.in_features * layer.out_features for _, layer, _ in layers)
            ways = [(route, lambda x, layer, w: layer(x)) for route in routes]
            ways.append(("torch bf16", lambda x, layer, w: torch.nn.functional.linear(x.bfloat16(), w)))
            best = {way: [float("inf")] * len(layers) for way, _ in ways}
            for _ in range(ns.repeats):
                for way, call in ways:
                    if way in routes:
                        ext.set_bf16_kernel_route(way)
                    for i, ((_, layer, w), x) in enumerate(zip(layers, xs)):
                        call(x, layer, w)  # warm
                        start = time.perf_counter()
                        call(x, layer, w)
                        best[way][i] = min(best[way][i], time.perf_counter() - start)
            for way, _ in ways:
                total = sum(best[way])
                parts = " ".join(f"{name} {1e3 * t:.3f}" for (name, _, _), t in zip(layers, best[way]))
                print(f"{rows:>5}  {way:<16} {1e3 * total:>12.3f} {macs / total / 1e9:>14.1f}  {parts}")
    finally:
        ext.set_bf16_kernel_route(own)


if __name__ == "__main__":
    main()
