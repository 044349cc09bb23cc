"""W6 per text: TPOT without speculation, with ``ngram`` and with ``draft_model`` (the model's
own int4 weights drafting), and each method's acceptance rate and mean accepted length per
text. The three engines run in the same process, each text round-robin over them (``--rounds``
times, each engine keeping its best), greedy, EOS ignored, batch 1. TPOT = (last token time -
first token time) / (tokens - 1), measured from the engine's step loop.

    python benchmarks/spec_w6.py [--model smollm2-135m-instruct] [--output-len 128] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import time

import platform

from kvserve.bench.machine import machine_load
from kvserve.bench.workloads import get_spec, load_text
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.request import SamplingParams


def run_one(engine: LLMEngine, prompt: list[int], n_out: int) -> dict:
    engine.kv_manager.reset_prefix_cache()
    before = engine.spec_stats()
    engine.add_request("w6", prompt, SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    stamps: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            stamps.extend([now] * len(o.outputs[0].delta_token_ids))
            tokens.extend(o.outputs[0].delta_token_ids)
    after = engine.spec_stats()
    steps, drafted, accepted = (after[k] - before[k] for k in
                                ("spec_num_steps", "spec_draft_tokens", "spec_accepted_tokens"))
    return {"tpot_ms": 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1), "tokens": tokens,
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / steps if steps else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    configs = {
        "nospec": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": ns.k},
        "draft_model": {"method": "draft_model", "model": ns.model, "quantization": "int4",
                        "num_speculative_tokens": ns.k},
    }
    engines = {name: LLMEngine(EngineArgs(model=ns.model, speculative_config=cfg, kv_cache_memory=256 << 20))
               for name, cfg in configs.items()}
    first = next(iter(engines.values()))
    print(f"{ns.model}, {first.describe_kv_cache()}")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"CPU: {cpu}; load {machine_load()}")
    warm = first.tokenizer.encode("def f(x):\n    return x + 1\n\ndef g(x):\n")
    for eng in engines.values():
        run_one(eng, warm, 8)
    results: dict = {}
    for text in get_spec("W6").texts:
        prompt = first.tokenizer.encode(load_text(text))
        best: dict = {}
        for _ in range(ns.rounds):
            for name, eng in engines.items():
                r = run_one(eng, prompt, ns.output_len)
                if name not in best or r["tpot_ms"] < best[name]["tpot_ms"]:
                    best[name] = r
        ref = best["nospec"]["tokens"]
        for name, r in best.items():
            assert r["tokens"] == ref or name == "nospec", f"{name} changed the greedy output of {text}"
            r.pop("tokens")
        results[text] = {"prompt_tokens": len(prompt), **best}
        base = best["nospec"]["tpot_ms"]
        print(f"{text} ({len(prompt)} prompt tokens): TPOT nospec {base:.1f} ms; " + "; ".join(
            f"{name} {r['tpot_ms']:.1f} ms ({r['tpot_ms'] / base:.2f}x), acceptance "
            f"{100 * r['acceptance']:.0f} %, mean accepted length {r['mean_accepted_length']:.2f}"
            for name, r in best.items() if name != "nospec"))
    for name in configs:
        mean = sum(r[name]["tpot_ms"] for r in results.values()) / len(results)
        base = sum(r["nospec"]["tpot_ms"] for r in results.values()) / len(results)
        print(f"mean TPOT {name}: {mean:.1f} ms ({mean / base:.2f}x nospec)")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
