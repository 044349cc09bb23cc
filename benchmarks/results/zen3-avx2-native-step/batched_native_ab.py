# In one process: a batch of greedy requests (W2-like: 32 x 64-token prompts, 128 tokens each) in the
# default mode (bf16 weights) or int4, with the native step (runner.native_rounds) and through the model
# in Python, alternated per batch; output tok/s of each batch.
# Usage: python batched_native_ab.py MODEL ROUNDS [QUANTIZATION]
import sys, time, random, statistics
from kvserve.llm import LLM
from kvserve.request import SamplingParams
quant = sys.argv[3] if len(sys.argv) > 3 else None
llm = LLM(sys.argv[1], quantization=quant, enable_prefix_caching=False)
runner = llm.engine.executor.runner
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
res = {True: [], False: []}; outs = {True: [], False: []}
for i in range(int(sys.argv[2])):
    prompts = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(32)]
    for native in ((True, False) if i % 2 == 0 else (False, True)):
        runner.native_rounds = native
        t = time.perf_counter(); o = llm.generate(prompts, sp, use_tqdm=False) if "use_tqdm" in LLM.generate.__code__.co_varnames else llm.generate(prompts, sp)
        res[native].append(32 * 128 / (time.perf_counter() - t)); outs[native].append([x.outputs[0].token_ids for x in o])
for k in (False, True):
    print("native" if k else "python", "median %.1f out tok/s  rounds %s" % (statistics.median(res[k]), " ".join("%.1f" % x for x in res[k])))
print("native/python per round (median): %.3fx" % statistics.median([b / a for a, b in zip(res[False], res[True])]))
print("identical tokens:", outs[True] == outs[False])
