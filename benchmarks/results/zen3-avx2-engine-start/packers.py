"""The load-time packers against their torch references, on the LM heads' shapes (random
weights; the same bytes either way, tests/test_quant.py and tests/test_dense_linear.py), best of
3, seconds."""
import time

import torch

from kvserve.quant import Q4Screen, Q8Linear, pack_bf16_weight, pack_bf16_weight_reference


def best(f, w):
    times = []
    for _ in range(3):
        t = time.perf_counter()
        f(w)
        times.append(time.perf_counter() - t)
    return min(times)


torch.manual_seed(0)
for name, shape in [("SmolLM2 head", (49152, 576)), ("Gemma 3 head", (262144, 640))]:
    w = torch.randn(*shape) * 0.05
    for what, ext, ref in [("4-bit screen", Q4Screen.from_float, Q4Screen.pack_reference),
                           ("Q8_0 head", Q8Linear.from_float, Q8Linear.quantize_reference),
                           ("bf16 panels", pack_bf16_weight, pack_bf16_weight_reference)]:
        a, b = best(ext, w), best(ref, w)
        print(f"{name:13s} {what:13s} kernel {a:.3f}  torch {b:.3f}  ({b / a:.1f}x)")
