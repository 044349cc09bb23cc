"""How coarse can the LM head's argmax screen be? The rank of the fp32 argmax among a simulated
screen's logits, over every position of the precision tests' texts, for weights at 4, 3 and 2
bits (asymmetric min/max per group, as kvserve.quant.Q4Screen) against activations rounded to
int8 per group of 64 (as the screen's kernel). The screen rescores its best SCREEN_TOP_K (64)
in fp32: a format is safe while the worst rank stays well below that.

    python benchmarks/screen_rank.py [--model gemma-3-270m] [--long-tokens 1200]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvserve.attention import build_attention_metadata
from kvserve.tokenizer import load_tokenizer
from kvserve.kv_cache import allocate_kv_cache
from kvserve.loader import load_model, resolve_model
from kvserve.quant import SCREEN_GROUP, SCREEN_TOP_K, quantize_min_max, screen_activations

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def head_inputs(model, config, token_ids: list[int]) -> torch.Tensor:
    """The final-normed hidden states the LM head sees at every position (one prefill)."""
    seen: list[torch.Tensor] = []
    head = model.lm_head
    forward = head.forward

    def capture(x, *args, **kwargs):
        seen.append(x.detach().clone())
        return forward(x, *args, **kwargs)

    object.__setattr__(head, "forward", capture)
    try:
        n = len(token_ids)
        blocks = -(-n // 16)
        kv = allocate_kv_cache(config, blocks, 16, torch.float32, "cpu")
        md = build_attention_metadata([list(range(blocks))], [0], [n], 16)
        with torch.inference_mode():
            model(torch.tensor(token_ids), torch.arange(n), md, kv, torch.arange(n))
    finally:
        object.__setattr__(head, "forward", forward)
    return torch.cat(seen)


def min_max_weights(weight: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The weights as a min/max screen of ``bits`` per ``group`` holds them (fp16 d and m)."""
    n, k = weight.shape
    q, d, m = quantize_min_max(weight, bits, group)
    return (q.view(n, k // group, group) * d[..., None] + m[..., None]).view(n, k)


def int8_activations(x: torch.Tensor, group: int = SCREEN_GROUP) -> torch.Tensor:
    """The activations as the screen's kernel rounds them (per group of 64), back in float."""
    q, scale = screen_activations(x.view(x.shape[0], -1, group))
    return (q * scale[..., None]).view_as(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--long-tokens", type=int, default=1200)
    ns = ap.parse_args()
    source = resolve_model(ns.model)
    model, config = load_model(source, dtype=torch.float32)
    tokenizer = load_tokenizer(source)
    texts = [tokenizer.encode((DATA / "tolerance_text.txt").read_text()),
             tokenizer.encode((DATA / "long_text_gpl3.txt").read_text())[:ns.long_tokens]]
    hidden = torch.cat([head_inputs(model, config, ids) for ids in texts])
    weight = getattr(model.lm_head, "exact_weight", model.lm_head.weight).float()
    best = torch.cat([(rows @ weight.T).argmax(-1) for rows in hidden.split(128)])
    quantized = int8_activations(hidden)
    print(f"{ns.model}: {hidden.shape[0]} positions, vocabulary {weight.shape[0]}; the screen rescores its best {SCREEN_TOP_K}")
    for bits in (4, 3, 2):
        for group in (64, 32, 16):
            screen = min_max_weights(weight, bits, group)
            ranks = torch.cat([(approx > approx.gather(1, b[:, None])).sum(-1)
                               for approx, b in ((rows @ screen.T, b) for rows, b in zip(quantized.split(128), best.split(128)))])
            bytes_per_weight = bits / 8 + 4 / group  # fp16 d and m per group
            print(f"  {bits}-bit, min/max per {group} ({bytes_per_weight:.3f} B a weight): rank of the fp32 argmax "
                  f"max {ranks.max().item()}, p99 {ranks.float().quantile(0.99).item():.0f}, "
                  f"beyond {SCREEN_TOP_K}: {(ranks >= SCREEN_TOP_K).sum().item()}")


if __name__ == "__main__":
    main()
