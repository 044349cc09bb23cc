"""Where a speculative step's time goes, batch 1: per step that verifies 5 tokens (the last
token + 4 drafts), the mean time of each part, without the profiler (plain perf_counter
wrappers around the engine's parts), next to a plain decode step of the same engine
without speculation. Text: a W6 prompt, greedy, EOS ignored.

    python benchmarks/spec_step_breakdown.py [--text code_continue] [--output-len 128]
"""
from __future__ import annotations

import argparse

from decode_step_breakdown import print_parts, timed_steps  # benchmarks/, beside this script
from kvserve.bench.workloads import load_text
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine

PARTS = {  # (attribute path from the engine, method) -> part name
    ("speculator", "propose"): "drafter propose (n-gram lookup / draft plan)",
    ("scheduler", "schedule"): "scheduler.schedule",
    ("speculator", "fill"): "draft model (catch-up + k forwards + sampling)",
    ("executor.runner", "prepare_inputs"): "runner.prepare_inputs",
    ("executor.runner", "model"): "target forward",
    ("executor.runner", "sampler"): "sampler + verification",
    ("scheduler", "update_from_output"): "scheduler.update (accept, rollback, stops, detok)",
}


def breakdown(engine: LLMEngine, prompt: list[int], n_out: int) -> tuple[dict, int, float]:
    return timed_steps(engine, prompt, n_out, PARTS, tokens_per_step=5 if engine.speculator is not None else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--text", default="code_continue")
    ap.add_argument("--output-len", type=int, default=128)
    ns = ap.parse_args()
    configs = {"nospec (1 token)": None,
               "ngram (verifies 5)": {"method": "ngram", "num_speculative_tokens": 4},
               "draft_model int4 (verifies 5)": {"method": "draft_model", "model": ns.model,
                                                 "quantization": "int4", "num_speculative_tokens": 4}}
    for name, cfg in configs.items():
        engine = LLMEngine(EngineArgs(model=ns.model, speculative_config=cfg, kv_cache_memory=128 << 20))
        prompt = engine.tokenizer.encode(load_text(ns.text))
        breakdown(engine, prompt, 16)  # warm-up
        parts, steps, mean = breakdown(engine, prompt, ns.output_len)
        print(f"{name}: {steps} steps, {1e3 * mean:.2f} ms per step")
        print_parts(parts, PARTS.values(), mean, "rest of the step (detokenizer, outputs, ...)")


if __name__ == "__main__":
    main()
