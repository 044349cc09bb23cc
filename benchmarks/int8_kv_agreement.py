"""Greedy agreement of reduced-precision KV caches with an fp32 KV cache on held-out long code
(issue 64's check): 8 source files of installed packages (torch's own, never seen by the
tests' texts), each cut to 1,000-1,490 tokens, continued greedily for 32 tokens with fp32
weights; per KV dtype, how many of the 8 continuations are identical to the fp32 cache's and
the mean agreeing prefix (first differing token / 32, 1.0 when identical).

The 8 contexts run as one batch: one prefill step of every prompt, then one decode step of 8
rows per token (the kernels are batch-invariant, so a row's tokens are those it would get
alone). Prints the CPU.

    python benchmarks/int8_kv_agreement.py [--models smollm2-135m-instruct,gemma-3-270m]
        [--dtypes bfloat16,float16,int8] [--tokens 32]
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from kvserve.attention import build_attention_metadata
from kvserve.bench.machine import cpu_info
from kvserve.kv_cache import KVCache, allocate_kv_cache
from kvserve.loader import load_model, resolve_model
from kvserve.tokenizer import load_tokenizer

BLOCK = 16
# Held-out code: files of the installed torch package (paths relative to it), long enough for
# the longest cut. Context i keeps the first 1,000 + 70 i tokens.
HELD_OUT_FILES = ("nn/modules/conv.py", "nn/modules/rnn.py", "nn/modules/transformer.py", "optim/adam.py",
                  "optim/lr_scheduler.py", "utils/data/dataloader.py", "nn/modules/loss.py",
                  "nn/modules/activation.py")
FIRST_CONTEXT_TOKENS = 1000
CONTEXT_STEP_TOKENS = 70

KVDtype = Union[str, torch.dtype]
# A hook that builds the KV cache of a run (the scheme simulations of int8_kv_schemes.py).
CacheFactory = Callable[[object, int, KVDtype], KVCache]


def held_out_contexts(tokenizer) -> list[list[int]]:
    root = Path(torch.__file__).parent
    contexts = []
    for i, name in enumerate(HELD_OUT_FILES):
        ids = tokenizer.encode((root / name).read_text())
        length = FIRST_CONTEXT_TOKENS + CONTEXT_STEP_TOKENS * i
        if len(ids) < length:
            raise SystemExit(f"{root / name} has {len(ids)} tokens, fewer than the {length} its context needs")
        contexts.append(ids[:length])
    return contexts


def greedy_continuations(model, config, contexts: list[list[int]], kv_dtype: KVDtype, new_tokens: int,
                         cache_factory: Optional[CacheFactory] = None) -> list[list[int]]:
    """Each context continued greedily by ``new_tokens`` tokens, all contexts in one batch."""
    tables, next_block = [], 0
    for ids in contexts:
        n = -(-(len(ids) + new_tokens) // BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    kv = (cache_factory or (lambda c, nb, d: allocate_kv_cache(c, nb, BLOCK, d, "cpu")))(config, next_block, kv_dtype)
    lengths = [len(ids) for ids in contexts]
    md = build_attention_metadata(tables, [0] * len(contexts), lengths, BLOCK)
    last_rows = torch.tensor(lengths).cumsum(0) - 1
    outputs: list[list[int]] = [[] for _ in contexts]
    with torch.inference_mode():
        logits = model(torch.tensor([t for ids in contexts for t in ids]),
                       torch.cat([torch.arange(n) for n in lengths]), md, kv, last_rows)
        for step in range(new_tokens):
            tokens = logits.float().argmax(-1).tolist()
            for out, token in zip(outputs, tokens):
                out.append(token)
            if step == new_tokens - 1:
                break
            positions = [n + step for n in lengths]
            md = build_attention_metadata(tables, positions, [1] * len(contexts), BLOCK)
            logits = model(torch.tensor(tokens), torch.tensor(positions), md, kv,
                           torch.arange(len(contexts)))
    return outputs


@dataclass
class Agreement:
    identical: int
    total: int
    mean_prefix: float

    def describe(self) -> str:
        return f"{self.identical}/{self.total} identical, mean agreeing prefix {self.mean_prefix:.3f}"


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> Agreement:
    prefixes = []
    for out, ref in zip(outputs, reference):
        differing = [i for i, (a, b) in enumerate(zip(out, ref)) if a != b]
        prefixes.append((differing[0] if differing else len(ref)) / len(ref))
    return Agreement(sum(p == 1.0 for p in prefixes), len(prefixes), sum(prefixes) / len(prefixes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    parser.add_argument("--dtypes", default="bfloat16,float16,int8")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    print(f"CPU: {cpu_info()}")
    for name in args.models.split(","):
        source = resolve_model(name)
        model, config = load_model(source, dtype=torch.float32)
        contexts = held_out_contexts(load_tokenizer(source))
        reference = greedy_continuations(model, config, contexts, torch.float32, args.tokens)
        print(f"\n{name}, {len(contexts)} contexts of {min(map(len, contexts))}-{max(map(len, contexts))} tokens, "
              f"{args.tokens} greedy tokens against an fp32 KV cache:")
        print("| KV dtype | greedy identical | mean agreeing prefix |\n| --- | --- | --- |")
        for dtype in args.dtypes.split(","):
            result = agreement(greedy_continuations(model, config, contexts, dtype, args.tokens), reference)
            print(f"| {dtype} | {result.identical}/{result.total} | {result.mean_prefix:.3f} |", flush=True)


if __name__ == "__main__":
    main()
