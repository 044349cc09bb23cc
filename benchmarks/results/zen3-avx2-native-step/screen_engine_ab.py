# Two int4 engines in one process, alternated per request: the screen on huge pages (as loaded now)
# and the same screen copied back onto 4 KB pages; median decode step of each request.
# Usage: python screen_engine_ab.py MODEL ROUNDS
import sys, time, random, statistics, torch
from kvserve.llm import LLM
from kvserve.request import SamplingParams
model = sys.argv[1]
engines = {}
for name in ("huge", "4k"):
    llm = LLM(model, quantization="int4", enable_prefix_caching=False)
    if name == "4k":
        screen = llm.engine.executor.runner.model.lm_head.screen
        screen.packed = screen.packed.clone()
    engines[name] = llm
steps = {k: [] for k in engines}
for name, llm in engines.items():
    eng = llm.engine
    def wrapped(orig=eng.step, name=name):
        t = time.perf_counter(); r = orig(); steps[name].append(time.perf_counter() - t); return r
    eng.step = wrapped
sp = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
res = {k: [] for k in engines}; outs = {k: [] for k in engines}
for i in range(int(sys.argv[2])):
    prompt = [rng.randrange(100, 20000) for _ in range(128)]
    for name in (("huge", "4k") if i % 2 == 0 else ("4k", "huge")):
        steps[name].clear()
        o = engines[name].generate([prompt], sp)
        res[name].append(statistics.median(steps[name][2:]) * 1e3); outs[name].append(o[0].outputs[0].token_ids)
for k, v in res.items(): print(model, k, "median %.3f ms  rounds %s" % (statistics.median(v), " ".join("%.2f" % x for x in v)))
print("4k/huge per round (median): %.3fx; identical tokens: %s" % (statistics.median([a / b for a, b in zip(res["4k"], res["huge"])]), outs["4k"] == outs["huge"]))
