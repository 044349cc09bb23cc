"""Resident memory of a process holding one engine (KV pool capped at 64 MiB to leave it out),
after the imports, after the engine's start and after a 32-token greedy generation. Prints one
JSON line, in MiB. One process per line; to compare two builds, run once per build, each tree
with its own extension directory (results: benchmarks/results/zen3-avx2-engine-start):

    PYTHONPATH=<tree> TORCH_EXTENSIONS_DIR=<dir> python benchmarks/engine_memory.py MODEL none|int4
"""
import argparse
import json

import psutil


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("quantization", nargs="?", default="none", help="none (the default mode) | bf16 | int8 | int4")
    args = ap.parse_args()
    from kvserve.llm import LLM
    from kvserve.request import SamplingParams

    process = psutil.Process()
    after_import = process.memory_info().rss
    llm = LLM(model=args.model, quantization=args.quantization, kv_cache_memory=64 << 20)
    after_start = process.memory_info().rss
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, temperature=0.0))
    after_generate = process.memory_info().rss
    print(json.dumps({"model": args.model, "mode": args.quantization, "import_MiB": after_import >> 20,
                      "start_MiB": after_start >> 20, "generate_MiB": after_generate >> 20}))


if __name__ == "__main__":
    main()
