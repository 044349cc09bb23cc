"""A 256-token prompt and one generated token, int4 mode with bf16 against int8 prefill copies: two
engines in one process, alternated 12 times (the first 2 dropped), prompts shifted through the
long text and prefix caching off, so every prompt is computed.

    python ttft_ab.py smollm2-135m-instruct|gemma-3-270m
"""
import statistics
import sys
import time
from pathlib import Path

from kvserve.llm import LLM
from kvserve.request import SamplingParams
model = sys.argv[1]
engines = {fmt: LLM(model, quantization="int4", int4_prefill=fmt, enable_prefix_caching=False) for fmt in ("bf16", "int8")}
tok = engines["bf16"].tokenizer
text = (Path(__file__).resolve().parents[3] / "tests" / "data" / "long_text_gpl3.txt").read_text()
ids = tok.encode(text)
sp = SamplingParams(max_tokens=1, temperature=0.0)
times = {f: [] for f in engines}
for i in range(12):
    prompt = ids[i * 50: i * 50 + 256]
    for fmt, llm in engines.items():
        t = time.perf_counter(); out = llm.generate(prompt, sp); dt = time.perf_counter() - t
        if i >= 2: times[fmt].append(dt * 1e3)
for f, v in times.items():
    print(f"{model} int4 {f} copies: median {statistics.median(v):.1f} ms, min {min(v):.1f}")
print("int8 / bf16 median %.3f min %.3f" % (statistics.median(times['int8']) / statistics.median(times['bf16']), min(times['int8']) / min(times['bf16'])))
