"""INT8 KV quantization schemes compared before building one (issue 64): each scheme is simulated
on an fp32 cache (keys and values rounded through the scheme on their way in, stored
dequantized; fused decoder off, so every layer writes through ``LayerKV.write``), on both real
models: teacher-forced top-1 agreement and perplexity against a bf16 KV cache (the tolerance
text and the last 400 positions of a 2,200-token context, as tests/test_precision.py scores
them) and greedy agreement with an fp32 cache on held-out code (int8_kv_agreement.py).

The simulation rounds only the cache's contents: it leaves out the int8 attention tile's own
roundings (see ``--real``, which adds the engine's int8 cache as a row).

Schemes: ``h64`` Hadamard then one fp16 scale per token and 64 dims, keys and values (the
cache as issue 11 built it); ``h32k`` the same with 32-dim key groups; ``h32`` 32-dim groups for
both; ``kivi`` keys per channel over each 16-token block (scale fixed by the block's tokens, no
rotation, KIVI-style), values as h64.

    python benchmarks/int8_kv_schemes.py [--schemes h64,h32k,h32,kivi] [--real]
"""
from __future__ import annotations

import argparse
import contextlib
import math
from pathlib import Path
from typing import Callable

import torch

from benchmarks.int8_kv_agreement import BLOCK, agreement, greedy_continuations, held_out_contexts
from kvserve.attention import build_attention_metadata
from kvserve.bench.machine import cpu_info
from kvserve.kv_cache import INT8_MAX, SCALE_DTYPE, LayerKV, allocate_kv_cache, hadamard_transform
from kvserve.loader import load_model, resolve_model
from kvserve.tokenizer import load_tokenizer

DATA = Path(__file__).parent.parent / "tests" / "data"
LONG_CONTEXT_TOKENS, LONG_CONTEXT_SCORED = 2200, 400


def round_groups(x: torch.Tensor, group: int, rotate: bool = True) -> torch.Tensor:
    """``x [..., D]`` through symmetric int8 per token and ``group`` dims (fp16 scales), back to fp32."""
    y = hadamard_transform(x) if rotate else x.float()
    grouped = y.unflatten(-1, (-1, min(group, y.shape[-1])))
    s = (grouped.abs().amax(-1, keepdim=True) / INT8_MAX).to(SCALE_DTYPE).float()
    q = torch.where(s > 0, torch.round(grouped / s), torch.zeros_like(grouped)).clamp(-INT8_MAX, INT8_MAX)
    y = (q * s).flatten(-2)
    return hadamard_transform(y) if rotate else y


def round_channels_per_block(x: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """``x [T, KVH, D]``: one fp16 scale per channel and KV head over the tokens of each block
    written in this call (a whole block in a prompt; KIVI keeps a filling block unrounded)."""
    out = torch.empty_like(x, dtype=torch.float32)
    blocks = slot_mapping // BLOCK
    for block in blocks.unique():
        rows = (blocks == block).nonzero().flatten()
        xb = x[rows].float()  # [n, KVH, D]
        s = (xb.abs().amax(0, keepdim=True) / INT8_MAX).to(SCALE_DTYPE).float()
        q = torch.where(s > 0, torch.round(xb / s), torch.zeros_like(xb)).clamp(-INT8_MAX, INT8_MAX)
        out[rows] = q * s
    return out


Rounding = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
SCHEMES: dict[str, Rounding] = {
    "h64": lambda k, v, slots: (round_groups(k, 64), round_groups(v, 64)),
    "h32k": lambda k, v, slots: (round_groups(k, 32), round_groups(v, 64)),
    "h32": lambda k, v, slots: (round_groups(k, 32), round_groups(v, 32)),
    "kivi": lambda k, v, slots: (round_channels_per_block(k, slots), round_groups(v, 64)),
}


class SimulatedScheme:
    """While active, fp32 caches store keys and values rounded through ``rounding``."""

    def __init__(self, model, rounding: Rounding) -> None:
        self.decoder, self.rounding = model.model, rounding

    def __enter__(self) -> "SimulatedScheme":
        self.fused, self.decoder.fused_layers = self.decoder.fused_layers, None
        self.write = LayerKV.write
        rounding, write = self.rounding, self.write

        def rounded_write(kv: LayerKV, k, v, slot_mapping):
            k, v = rounding(k, v, slot_mapping)
            write(kv, k, v, slot_mapping)

        LayerKV.write = rounded_write
        return self

    def __exit__(self, *exc) -> None:
        LayerKV.write = self.write
        self.decoder.fused_layers = self.fused


def position_logits(model, config, ids: list[int], kv_dtype, first_position: int) -> torch.Tensor:
    n = len(ids)
    nb = -(-n // BLOCK)
    kv = allocate_kv_cache(config, nb, BLOCK, kv_dtype, "cpu")
    md = build_attention_metadata([list(range(nb))], [0], [n], BLOCK)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(n), md, kv, torch.arange(first_position, n - 1)).float()


def teacher_forced(logits: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> str:
    target = torch.tensor(ids[-len(logits):])
    ppl = math.exp(torch.nn.functional.cross_entropy(logits, target).item())
    ref_ppl = math.exp(torch.nn.functional.cross_entropy(ref, target).item())
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return f"{100 * top1:.2f} % ({ppl / ref_ppl - 1:+.4f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--real", action="store_true", help="add the engine's int8 cache as a row")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--no-greedy", action="store_true", help="teacher-forced columns only (minutes less)")
    args = parser.parse_args()
    print(f"CPU: {cpu_info()}")
    for name in args.models.split(","):
        source = resolve_model(name)
        model, config = load_model(source, dtype=torch.float32)
        tokenizer = load_tokenizer(source)
        texts = {"tolerance": (tokenizer.encode((DATA / "tolerance_text.txt").read_text()), 0)}
        long_ids = tokenizer.encode((DATA / "long_text_gpl3.txt").read_text())[:LONG_CONTEXT_TOKENS]
        texts["long"] = (long_ids, LONG_CONTEXT_TOKENS - 1 - LONG_CONTEXT_SCORED)
        refs = {t: position_logits(model, config, ids, torch.bfloat16, first) for t, (ids, first) in texts.items()}
        contexts = held_out_contexts(tokenizer)
        greedy_ref = None if args.no_greedy else greedy_continuations(model, config, contexts, torch.float32,
                                                                      args.tokens)
        print(f"\n{name}: top-1 vs bf16 KV (perplexity ratio - 1), greedy vs fp32 KV on held-out code")
        print("| scheme | tolerance text | 2,200 tokens | greedy identical | mean agreeing prefix |")
        print("| --- | --- | --- | --- | --- |")
        rows = [(s, SCHEMES[s]) for s in args.schemes.split(",")] + ([("int8 (engine)", None)] if args.real else [])
        for scheme, rounding in rows:
            dtype = "int8" if rounding is None else torch.float32
            with SimulatedScheme(model, rounding) if rounding is not None else contextlib.nullcontext():
                cells = [teacher_forced(position_logits(model, config, ids, dtype, first), refs[t], ids)
                         for t, (ids, first) in texts.items()]
                if greedy_ref is not None:
                    greedy = agreement(greedy_continuations(model, config, contexts, dtype, args.tokens), greedy_ref)
                    cells += [f"{greedy.identical}/{greedy.total}", f"{greedy.mean_prefix:.3f}"]
                else:
                    cells += ["-", "-"]
            print(f"| {scheme} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
