import sys, time, statistics
from pathlib import Path
from kvserve.llm import LLM
from kvserve.request import SamplingParams
model = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 20
llm = LLM(model, quantization="int4", int4_prefill="int8", enable_prefix_caching=False)
ids = llm.tokenizer.encode(Path("/work/main/tests/data/long_text_gpl3.txt").read_text())
sp = SamplingParams(max_tokens=1, temperature=0.0)
ts = []
for i in range(n):
    t = time.perf_counter(); llm.generate(ids[i*50:i*50+256], sp); ts.append((time.perf_counter()-t)*1e3)
print(model, "median %.1f min %.1f" % (statistics.median(ts[2:]), min(ts[2:])))
