"""Engine start time: one process imports kvserve, starts an engine (its first start: the
tokenizer's load, torch's first uses, the KV pool's first touch), drops it and starts another
(what every later engine in a process pays: a test, a draft model). Prints one JSON line, in
seconds: the import, the first and the second start, and import + first start.

To compare two builds, run once per build, the builds alternated, each tree with its own
extension directory (results: benchmarks/results/zen3-avx2-engine-start):

    PYTHONPATH=<tree> TORCH_EXTENSIONS_DIR=<dir> python benchmarks/engine_start.py MODEL none|int4
"""
import time

t0 = time.perf_counter()
import argparse  # noqa: E402
import json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("quantization", nargs="?", default="none", help="none (the default mode) | bf16 | int8 | int4")
    args = ap.parse_args()
    from kvserve.llm import LLM  # timed: the import is part of a process's start

    import_s = time.perf_counter() - t0
    times = []
    for _ in range(2):
        t = time.perf_counter()
        llm = LLM(model=args.model, quantization=args.quantization)
        times.append(time.perf_counter() - t)
        del llm
    print(json.dumps({"import": round(import_s, 2), "first": round(times[0], 2), "second": round(times[1], 2),
                      "total_first": round(time.perf_counter() - t0 - times[1], 2)}))


if __name__ == "__main__":
    main()
