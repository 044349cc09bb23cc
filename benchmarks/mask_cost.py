"""The grammar constraint's own cost per decode step, without a model: every row's bitmask
filled by its grammar (structured_tpot.py's schema, a few tokens into a record) and applied
to random logits, at batch 1 and 32. "before" is the previous path (unpack the bitmask to
bools, numpy select), kept here as the baseline; "after" is the sampler's (the fused
kernel on the packed bitmask). This thread's CPU time, best of 5 x 30 calls: steadier than
wall time on a shared machine.

    python benchmarks/mask_cost.py [--model smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from kvserve import SamplingParams
from kvserve.loader.resolve import resolve_model
from kvserve.request import Request
from kvserve.sampler import apply_allowed_tokens, grammar_masks
from kvserve.structured import StructuredOutputsParams
from kvserve.structured.grammar import GrammarCompiler
from kvserve.tokenizer import Tokenizer

sys.path.insert(0, os.path.dirname(__file__))
from structured_tpot import SCHEMA  # noqa: E402


def before(requests: list[Request], logits: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    rows, bitmask = grammar_masks(requests, vocab)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
    return torch.from_numpy(np.where(allowed, logits.numpy(), np.float32(-np.inf)))


def after(requests: list[Request], logits: torch.Tensor) -> torch.Tensor:
    return apply_allowed_tokens(logits, *grammar_masks(requests, logits.shape[1]))


def best_time(fn, *args) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(30):
            fn(*args)
        best = min(best, (time.thread_time() - t0) / 30)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_gguf(resolve_model(args.model).path)
    vocab = tokenizer.vocab_size
    compiled = GrammarCompiler(tokenizer.hf, vocab, tokenizer.eos_token_ids).compile(
        StructuredOutputsParams(json=SCHEMA))
    prefix = tokenizer.encode('{"records": [{"name": "Ann', add_special_tokens=False)
    for batch in (1, 32):
        requests = []
        for i in range(batch):
            request = Request(f"m{i}", [1], SamplingParams())
            request.grammar = compiled.new_state()
            assert all(request.grammar.accept(t) for t in prefix)
            requests.append(request)
        logits = torch.randn(batch, vocab)
        assert torch.equal(before(requests, logits), after(requests, logits))
        fill = best_time(grammar_masks, requests, vocab)
        print(f"batch {batch:2d}: before {1e3 * best_time(before, requests, logits):.3f} ms, "
              f"after {1e3 * best_time(after, requests, logits):.3f} ms per step "
              f"(bitmask fill alone {1e3 * fill:.3f} ms)")


if __name__ == "__main__":
    main()
