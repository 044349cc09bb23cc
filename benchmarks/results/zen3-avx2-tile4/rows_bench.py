"""SmolLM2's four decoder GEMM shapes through Bf16Linear at several row counts (the AVX2 tile
split: M mod 6), the best of 3 rounds of each median."""
import statistics
import time

import torch

from kvserve.quant import Bf16Linear
torch.manual_seed(0)
layers = [Bf16Linear(torch.randn(n, k) * 0.02, None) for n, k in [(3072, 576), (576, 1536), (960, 576), (576, 576)]]
def t(M, reps=40):
    x = {576: torch.randn(M, 576), 1536: torch.randn(M, 1536)}
    ts = []
    for _ in range(reps):
        s = time.perf_counter()
        for _ in range(3):
            for l in layers:
                l(x[l.in_features])
        ts.append(time.perf_counter() - s)
    return statistics.median(ts)
with torch.inference_mode():
    t(8)
    res = {}
    for rnd in range(3):
        for M in [24, 26, 30, 31, 32, 36, 8, 7, 11, 12]:
            res.setdefault(M, []).append(t(M))
    for M, v in res.items():
        m = min(v)
        print("M=%2d  %.3f ms  %.4f ms/row" % (M, m * 1e3, m * 1e3 / M))
