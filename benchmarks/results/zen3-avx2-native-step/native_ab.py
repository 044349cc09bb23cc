# In one process: single-stream greedy int4 decode steps with the native step (runner.native_rounds)
# and through the model in Python, alternated per request; the median step of each request.
# Usage: python native_ab.py MODEL ROUNDS
import sys, time, random, statistics
from kvserve.llm import LLM
from kvserve.request import SamplingParams
llm = LLM(sys.argv[1], quantization="int4", enable_prefix_caching=False)
eng = llm.engine; runner = eng.executor.runner
steps = []
orig = eng.step
def wrapped():
    t = time.perf_counter(); r = orig(); steps.append(time.perf_counter() - t); return r
eng.step = wrapped
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
res = {True: [], False: []}; outs = {True: [], False: []}
for i in range(int(sys.argv[2])):
    prompt = [rng.randrange(100, 20000) for _ in range(128)]
    for native in ((True, False) if i % 2 == 0 else (False, True)):
        runner.native_rounds = native
        steps.clear()
        o = llm.generate([prompt], sp)
        res[native].append(statistics.median(steps[2:]) * 1e3); outs[native].append(o[0].outputs[0].token_ids)
for k in (False, True):
    print("native" if k else "python", "median %.3f ms  rounds %s" % (statistics.median(res[k]), " ".join("%.2f" % x for x in res[k])))
print("python/native per round (median): %.3fx" % statistics.median([a / b for a, b in zip(res[False], res[True])]))
print("identical tokens:", outs[True] == outs[False])
