"""Where a single-stream decode step's time goes, per token: the engine's parts (scheduler,
input preparation, sampler, output processing) and the model's (embedding, decoder layers,
final norm, LM head), timed with perf_counter wrappers (no profiler: its per-op cost would
swamp a ~10 ms step), over the decode steps of one greedy request. The decoder layers are
split further by timing each linear layer's kernel alone on the step's one row (the weights
then stream from memory as in the step), the remainder being attention, norms, rope and the
native loop itself.

    python benchmarks/decode_step_breakdown.py [--model gemma-3-270m] [--quantization int4]
"""
from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict

import torch

from kvserve.bench.workloads import load_text
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.request import SamplingParams

ENGINE_PARTS = {  # (attribute path from the engine, method) -> part
    ("scheduler", "schedule"): "scheduler.schedule",
    ("executor.runner", "prepare_inputs"): "runner.prepare_inputs",
    ("executor.runner.model.model", "forward"): "decoder (embedding, rope, layers)",
    ("executor.runner.model.model.norm", "forward"): "final norm",
    ("executor.runner.model.lm_head", "forward"): "LM head (+ fp32 rescoring of the top 16)",
    ("executor.runner", "sampler"): "sampler",
    ("scheduler", "update_from_output"): "scheduler.update (stops, detokenizer)",
}


def _resolve(engine: LLMEngine, path: str):
    owner = engine
    for name in path.split("."):
        owner = getattr(owner, name, None)
        if owner is None:
            return None
    return owner


def instrument(engine: LLMEngine, acc: dict) -> None:
    for (path, method), part in ENGINE_PARTS.items():
        owner = _resolve(engine, path)
        if owner is None:
            continue
        fn = getattr(owner, method)

        def timed(*a, __fn=fn, __part=part, **kw):
            t0 = time.perf_counter()
            try:
                return __fn(*a, **kw)
            finally:
                acc[__part] += time.perf_counter() - t0

        # An instance attribute shadows the class's method (and nn.Module.__call__ finds it).
        object.__setattr__(owner, method, timed)


def decode_steps(engine: LLMEngine, prompt: list[int], n_out: int) -> tuple[dict, int, float]:
    acc: dict = defaultdict(float)
    instrument(engine, acc)
    engine.add_request(f"r{time.monotonic_ns()}", prompt,
                       SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    totals: dict = defaultdict(float)
    steps, step_time = 0, 0.0
    while engine.has_unfinished_requests():
        acc.clear()
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        last = engine.counters.step_history[-1]
        if last.num_prefill_tokens == 0 and last.num_decode_tokens == 1:
            steps += 1
            step_time += dt
            for k, v in acc.items():
                totals[k] += v
    return {k: v / steps for k, v in totals.items()}, steps, step_time / steps


def linear_kernels_alone(model: torch.nn.Module, repeats: int = 20) -> float:
    """Seconds for one row through every decoder linear layer in turn (their decode format)."""
    linears = [m for name, m in model.model.layers.named_modules()
               if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    rows = [torch.randn(1, m.in_features) for m in linears]
    blocks = [getattr(m, "forward_blocks", m) for m in linears]
    for f, x in zip(blocks, rows):
        f(x)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for f, x in zip(blocks, rows):
            f(x)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--text", default="code_continue")
    ap.add_argument("--output-len", type=int, default=128)
    ns = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=ns.model, quantization=ns.quantization or None,
                                  kv_cache_memory=128 << 20))
    prompt = engine.tokenizer.encode(load_text(ns.text))[:256]
    decode_steps(engine, prompt, 16)  # warm-up
    parts, steps, mean = decode_steps(engine, prompt, ns.output_len)
    print(f"{ns.model} ({ns.quantization or 'default'} weights), {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}: {steps} decode steps after a {len(prompt)}-token "
          f"prompt, {1e3 * mean:.2f} ms per step")
    for part in ENGINE_PARTS.values():
        if part in parts:
            print(f"    {part:<52} {1e3 * parts[part]:7.2f} ms  {100 * parts[part] / mean:5.1f} %")
            if part.startswith("decoder"):
                linears = linear_kernels_alone(engine.executor.runner.model)
                print(f"      {'of which linear kernels (timed alone)':<50} {1e3 * linears:7.2f} ms")
                print(f"      {'of which the rest (attention, norms, rope, loop)':<50} "
                      f"{1e3 * (parts[part] - linears):7.2f} ms")
    rest = mean - sum(parts.values())
    print(f"    {'rest of the step (outputs, bookkeeping)':<52} {1e3 * rest:7.2f} ms  {100 * rest / mean:5.1f} %")


if __name__ == "__main__":
    main()
