"""TPOT with and without a JSON-schema constraint, at batch 1 and batch 32 (issue bar: at
most 5 % overhead). The same prompts run both ways, alternating, in one process; the figure
is the median decode-step time over steps where every sequence of the batch decodes (so the
batch size is what it says), i.e. the time per output token of each sequence. On a shared
machine wall time swings with the other processes' load; the step's CPU time (this
process, all threads) is printed beside it and is the steadier comparison.

    python benchmarks/structured_tpot.py [--model smollm2-135m-instruct] [--steps 48] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from kvserve import SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.structured import StructuredOutputsParams

# A long-running structure: a list of records a model keeps extending.
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["name", "city", "age", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}
PROMPT = ("<|im_start|>user\nList as many people as you can, as JSON records with name, city, "
          "age and tags.<|im_end|>\n<|im_start|>assistant\n")


def decode_step_times(engine: LLMEngine, batch: int, steps: int, constrained: bool
                      ) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each full-batch decode step."""
    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=not constrained,
                            structured_outputs=spec)
    ids = [engine.add_request(None, PROMPT + " " * i, params) for i in range(batch)]
    times = []
    while engine.has_unfinished_requests():
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        dt = (time.perf_counter() - t0, time.process_time() - c0)
        last = engine.counters.step_history[-1] if engine.counters.step_history else None
        if last is not None and last.num_prefill_tokens == 0 and last.num_decode_tokens == batch:
            times.append(dt)
        if len(times) >= steps:
            engine.abort_request(ids)
            engine.step()
            break
    return times


def mask_cost(engine: LLMEngine, batch: int, iters: int = 50) -> float:
    """Seconds per step that the constraint adds on its own: every row's bitmask filled by
    its grammar and applied to the logits (less noisy than a step difference)."""
    import torch

    from kvserve.request import Request
    from kvserve.sampler import apply_allowed_tokens, grammar_masks

    compiled = engine.grammar_compiler.compile(StructuredOutputsParams(json=SCHEMA))
    prefix = engine.tokenizer.encode('{"records": [{"name": "Ann', add_special_tokens=False)
    requests = []
    for i in range(batch):
        req = Request(f"m{i}", [1], SamplingParams())
        req.grammar = compiled.new_state()
        for t in prefix:
            assert req.grammar.accept(t)
        requests.append(req)
    vocab = engine.model_config.vocab_size
    logits = torch.randn(batch, vocab)
    # This thread's CPU time: the work runs on it alone, and other processes' load does not
    # inflate it (wall time on a shared machine did, several-fold).
    t0 = time.thread_time()
    for _ in range(iters):
        rows, bitmask = grammar_masks(requests, vocab)
        apply_allowed_tokens(logits, rows, bitmask)
    return (time.thread_time() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, max_num_seqs=64))
    print(f"model {args.model}; {engine.describe_kv_cache()}; CPU: {_cpu()}")
    engine.grammar_compiler.compile(StructuredOutputsParams(json=SCHEMA))  # compile outside timing
    decode_step_times(engine, 2, 4, True)  # warm-up
    for batch in [int(b) for b in args.batches.split(",")]:
        per = {False: [], True: []}
        for _ in range(args.rounds):
            for constrained in (False, True):
                per[constrained] += decode_step_times(engine, batch, args.steps, constrained)
        free, bound = (statistics.median(t for t, _ in per[c]) for c in (False, True))
        free_cpu, bound_cpu = (statistics.median(c for _, c in per[k]) for k in (False, True))
        cost = mask_cost(engine, batch)
        print(f"batch {batch:3d}: mask fill + apply alone {1e3 * cost:.2f} ms per step "
              f"= {100 * cost / free:.1f} % of the unconstrained step")
        print(f"batch {batch:3d}: TPOT unconstrained {1e3 * free:.2f} ms, JSON-schema constrained "
              f"{1e3 * bound:.2f} ms -> overhead {100 * (bound / free - 1):+.1f} % "
              f"({len(per[False])}/{len(per[True])} full-batch steps)")
        print(f"batch {batch:3d}: CPU per step unconstrained {1e3 * free_cpu:.2f} ms, constrained "
              f"{1e3 * bound_cpu:.2f} ms -> overhead {100 * (bound_cpu / free_cpu - 1):+.1f} %")


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
