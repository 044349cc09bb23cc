"""A prompt's prefill through the decoder with every row computed to the end, against only the
row whose logits are wanted past the last layer's attention (models/base.py's last_layer_rows:
the other rows skip that layer's output projection and MLP, as in the engine since 23fc98f).
One process, the two ways alternated call by call (the machine is shared and noisy: compare
the ratio); a bf16 KV cache, the prompt as one chunk, each row in its prompt role (int4 mode's
prompt rows run on its prefill copies).

    python benchmarks/last_layer_rows.py [--model gemma-3-270m] [--quantization int4]
        [--prompt 256] [--repeats 9]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvserve.attention import build_attention_metadata
from kvserve.bench.machine import cpu_info
from kvserve.kv_cache import allocate_kv_cache
from kvserve.loader import load_model
from kvserve.loader.resolve import resolve_model
from kvserve.token_roles import TokenRoles, use_token_roles

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="bf16", choices=["bf16", "int4", "none"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    model, cfg = load_model(resolve_model(args.model), quantization=quantization)
    n = args.prompt
    blocks = -(-n // BLOCK)
    caches = allocate_kv_cache(cfg, blocks + 1, BLOCK, "bfloat16", "cpu")
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(n)
    md = build_attention_metadata([list(range(1, blocks + 1))], [0], [n], BLOCK)
    roles = TokenRoles.from_mask(np.ones(n, dtype=bool))
    last_row = torch.tensor([n - 1])

    def prefill_ms(rows) -> float:
        with use_token_roles(roles), torch.inference_mode():
            start = time.perf_counter()
            model.model(ids, positions, md, caches, rows)
            return (time.perf_counter() - start) * 1e3

    for _ in range(2):  # warm-up
        prefill_ms(None), prefill_ms(last_row)
    every, last = [], []
    for _ in range(args.repeats):
        every.append(prefill_ms(None))
        last.append(prefill_ms(last_row))
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} ({', '.join(cpu['features'])}), {torch.get_num_threads()} threads")
    print(f"{args.model} ({args.quantization} weights), a {n}-token prefill through {cfg.num_hidden_layers} layers, "
          f"{args.repeats} alternations:")
    for name, times in (("every row", every), ("the last row only", last)):
        print(f"  {name:<18} median {statistics.median(times):7.1f} ms, min {min(times):7.1f} ms")
    print(f"  last / every: median {statistics.median(last) / statistics.median(every):.3f}x, "
          f"min {min(last) / min(every):.3f}x")


if __name__ == "__main__":
    main()
