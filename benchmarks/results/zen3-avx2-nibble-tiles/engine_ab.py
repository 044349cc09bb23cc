# In one process: int4 engines with the nibble layers in the row layout (97bd1cf's AVX2 kernel, Q5_0
# as Q8_0) and in the tiled layout (the AVX2 tile kernel), alternated per request; argv[2] =
# construction order ("rows,tiles" or "tiles,rows"). Needs a tree with rows_kernel_restored.patch
# applied (the row kernel is gone from this one): copy the checkout, `patch -p1 < ...`, then run with
# PYTHONPATH=<copy> TORCH_EXTENSIONS_DIR=<a directory of its own>.
# Usage: python engine_ab.py MODEL rows,tiles [ROUNDS]
import sys, time, statistics, random
import kvserve.quant as quant
from kvserve.llm import LLM
from kvserve.request import SamplingParams
model, order = sys.argv[1], sys.argv[2].split(",")
engines = {}
for name in order:
    quant.tiled_nibble_kernels = lambda tiled=(name == "tiles"): tiled
    engines[name] = LLM(model, quantization="int4", enable_prefix_caching=False)
steps = {k: [] for k in engines}
for name, llm in engines.items():
    eng = llm.engine
    def wrapped(orig=eng.step, name=name):
        t = time.perf_counter(); r = orig(); steps[name].append(time.perf_counter() - t); return r
    eng.step = wrapped
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
per_round = {k: [] for k in engines}
outs = {k: [] for k in engines}
for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 8):
    prompt = [rng.randrange(100, 20000) for _ in range(128)]
    for name in (order if i % 2 == 0 else order[::-1]):
        steps[name].clear()
        o = engines[name].generate([prompt], sp)
        per_round[name].append(statistics.median(steps[name][2:]) * 1e3)
        outs[name].append(o[0].outputs[0].token_ids)
for k, v in per_round.items():
    print(model, k, "median decode step ms: median %.3f  min %.3f  rounds %s" % (statistics.median(v), min(v), " ".join("%.2f" % x for x in v)))
r, t = per_round["rows"], per_round["tiles"]
print("rows/tiles per round (median): %.3fx" % statistics.median([a / b for a, b in zip(r, t)]))
print("identical greedy outputs:", outs["rows"] == outs["tiles"])
