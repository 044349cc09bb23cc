"""Where a batched decode step's time goes (W2-like: B requests of 64 prompt tokens decoding
together), per part of the engine, with the sampling parameters a server's clients send:
greedy requests rank the vocabulary with the LM head's screen, sampled ones need every logit
and go through the sampler. The same perf_counter wrappers as decode_step_breakdown.py.

    python benchmarks/batched_step_breakdown.py [--model gemma-3-270m] [--quantization int4]
        [--batch 32] [--temperature 0.8] [--top-p 0.95] [--top-k 0] [--min-p 0.0]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from decode_step_breakdown import ENGINE_PARTS, instrument, print_parts, step_to_the_end
from kvserve.bench.machine import cpu_info
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.request import SamplingParams


def batched_decode_steps(engine: LLMEngine, acc: dict, batch: int, n_out: int,
                         params: dict) -> tuple[dict, int, float]:
    """``batch`` requests to the end; for the steps that decode all of them and prefill
    nothing: (mean seconds per part, number of such steps, mean seconds per step)."""
    for i in range(batch):
        prompt = list(range(1000 + 64 * i, 1064 + 64 * i))
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt,
                           SamplingParams(max_tokens=n_out, ignore_eos=True, **params))
    return step_to_the_end(engine, acc, batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ns = ap.parse_args()
    params = dict(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p)
    engine = LLMEngine(EngineArgs(model=ns.model, quantization=ns.quantization))
    acc: dict = defaultdict(float)
    instrument(engine, acc, ENGINE_PARTS)
    batched_decode_steps(engine, acc, ns.batch, 8, params)  # warm-up
    parts, steps, mean = batched_decode_steps(engine, acc, ns.batch, ns.output_len, params)
    cpu = cpu_info()
    print(f"{ns.model} ({ns.quantization or 'default'} weights), {torch.get_num_threads()} threads, "
          f"{cpu['model']} [{' '.join(cpu['features'])}]: {steps} decode steps of {ns.batch} requests "
          f"({', '.join(f'{k} {v:g}' for k, v in params.items())}), {1e3 * mean:.2f} ms per step")
    print_parts(parts, ENGINE_PARTS.values(), mean)


if __name__ == "__main__":
    main()
