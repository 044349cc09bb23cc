"""The LM head's full logits (every step that samples, or asks for logprobs) in the default mode's
bf16 against Q8_0 blocks (int4 mode's head; the blocks the embedding table now holds), on random
Q8_0-valued tables of both models' head shapes: the median of 12 calls each, every call after a
96 MB flood (a step's weights evict the head between its calls).

    python head_formats.py
"""
import statistics
import time

import torch

from kvserve.quant import Bf16Linear, Q8Linear
from kvserve.row_table import Q8Table

torch.manual_seed(0)
flood = torch.empty(96 << 18)  # 96 MB: the step's weights evict the head between calls
for name, (V, K) in {"smollm2": (49152, 576), "gemma3": (262144, 640)}.items():
    w = Q8Table(*Q8Linear.quantize_reference(torch.randn(V, K) * 0.05)).dequantized()
    heads = {"bf16": Bf16Linear(w, None), "q8": Q8Linear.from_float(w)}
    for rows in (1, 4, 16, 32):
        x = torch.randn(rows, K)
        ts = {k: [] for k in heads}
        for r in range(12):
            for k, h in heads.items():
                flood.fill_(r)
                t = time.perf_counter(); h(x); ts[k].append(time.perf_counter() - t)
        b, q = statistics.median(ts["bf16"]) * 1e3, statistics.median(ts["q8"]) * 1e3
        print(f"{name} rows {rows}: bf16 {b:.2f} ms, q8 {q:.2f} ms, q8/bf16 {q/b:.2f}", flush=True)
