"""A/B in one process: the default bf16 model's forward with kvserve's batch-invariant bf16
kernel (csrc/dense_linear.cpp) against the same weights through oneDNN's pre-packed matmul
(what kvserve called before issue #15), alternating, on the shapes of W1-W3: a batch-1 decode
step (W3 TPOT), a 16- and 32-row decode step (W2), 256- and 512-token prefills (W3 TTFT, W1).

    python benchmarks/determinism_ab.py --model smollm2-135m-instruct --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.attention import build_attention_metadata
from kvserve.kv_cache import allocate_kv_cache
from kvserve.loader import load_model, resolve_model
from kvserve.models.fused import attach_fused_layers
from kvserve.quant import Bf16Linear, unpack_bf16_weight


def to_onednn(model: torch.nn.Module) -> None:
    """Re-store every packed Bf16Linear as oneDNN's pre-packed weight (the old path)."""
    for module in model.modules():
        if isinstance(module, Bf16Linear) and module.packed:
            w = unpack_bf16_weight(module.weight, module.out_features, module.in_features).contiguous()
            module.weight = torch.ops.mkldnn._reorder_linear_weight(w, None)
            if module.bias is not None:
                module.bias = module.bias.to(torch.bfloat16)
            module.packed, module.prepacked = False, True
    attach_fused_layers(model)


def step_time(model, config, num_seqs: int, query_len: int, context: int, reps: int) -> float:
    blocks_per_seq = -(-(context + query_len) // 16)
    caches = allocate_kv_cache(config, num_seqs * blocks_per_seq, 16, torch.bfloat16, "cpu")
    tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(num_seqs)]
    md = build_attention_metadata(tables, [context] * num_seqs, [query_len] * num_seqs, 16)
    ids = torch.randint(100, 30000, (num_seqs * query_len,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(context, context + query_len)] * num_seqs)
    last = torch.tensor(md.query_start_loc[1:]) - 1
    with torch.inference_mode():
        model(ids, pos, md, caches, last)
        t0 = time.perf_counter()
        for _ in range(reps):
            model(ids, pos, md, caches, last)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    source = resolve_model(args.model)
    ours, config = load_model(source, quantization="bf16")
    onednn, _ = load_model(source, quantization="bf16")
    to_onednn(onednn)
    cases = {"decode x1 (W3 TPOT)": (1, 1, 256, 10), "decode x16 (W2)": (16, 1, 128, 5),
             "decode x32 (W2)": (32, 1, 128, 3), "prefill 256 (W3 TTFT)": (1, 256, 0, 1),
             "prefill 512 (W1)": (1, 512, 0, 1)}
    for name, (seqs, qlen, ctx, reps) in cases.items():
        a, b = [], []
        for _ in range(args.rounds):  # alternate: the machine's load drifts
            a.append(step_time(onednn, config, seqs, qlen, ctx, reps))
            b.append(step_time(ours, config, seqs, qlen, ctx, reps))
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{args.model} {name:22s} oneDNN {ma * 1e3:8.2f} ms  kvserve {mb * 1e3:8.2f} ms  "
              f"speed ratio kvserve/oneDNN {ma / mb:5.2f}  (min-based {min(a) / min(b):5.2f})", flush=True)


if __name__ == "__main__":
    main()
