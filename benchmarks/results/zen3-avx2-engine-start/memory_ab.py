"""Resident memory of a process holding one engine (KV pool capped at 64 MiB to leave it out),
after the start and after a 32-token greedy generation. One process per line:

    PYTHONPATH=<tree> TORCH_EXTENSIONS_DIR=<dir> python memory_ab.py MODEL none|int4
"""
import json
import sys

import psutil

from kvserve.llm import LLM
from kvserve.request import SamplingParams

model, quantization = sys.argv[1], sys.argv[2]
process = psutil.Process()
after_import = process.memory_info().rss
llm = LLM(model=model, quantization=quantization, kv_cache_memory=64 << 20)
after_start = process.memory_info().rss
llm.generate(["The capital of France is"], SamplingParams(max_tokens=32, temperature=0.0))
after_generate = process.memory_info().rss
print(json.dumps({"model": model, "mode": quantization, "import_MiB": after_import >> 20,
                  "start_MiB": after_start >> 20, "generate_MiB": after_generate >> 20}))
