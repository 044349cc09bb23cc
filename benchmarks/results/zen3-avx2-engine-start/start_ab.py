"""Engine start time: one process imports kvserve, starts an engine (its first start: the
tokenizer's load, torch's first uses, the KV pool's first touch), drops it and starts another
(what every later engine in a process pays: a test, a draft model). Run once per build, the
builds alternated, each with its own extension directory:

    PYTHONPATH=<tree> TORCH_EXTENSIONS_DIR=<dir> python start_ab.py MODEL none|int4
"""
import json
import sys
import time

t0 = time.perf_counter()
from kvserve.llm import LLM  # noqa: E402

import_s = time.perf_counter() - t0
model, quantization = sys.argv[1], sys.argv[2]
times = []
for _ in range(2):
    t = time.perf_counter()
    llm = LLM(model=model, quantization=quantization)
    times.append(time.perf_counter() - t)
    del llm
print(json.dumps({"import": round(import_s, 2), "first": round(times[0], 2), "second": round(times[1], 2),
                  "total_first": round(time.perf_counter() - t0 - times[1], 2)}))
