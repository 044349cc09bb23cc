# Median per-step time of the engine's parts (schedule, build, prepare, the native step, apply,
# outputs) over single-stream int4 decode steps, perf_counter wrappers. Usage: python engine_parts.py MODEL REQUESTS
import sys, time, random, statistics
from collections import defaultdict
from kvserve.llm import LLM
from kvserve.request import SamplingParams
from kvserve import engine as E, runner as R, scheduler as S, output_processor as O
from kvserve.executor import builder as BLD
llm = LLM(sys.argv[1], quantization="int4", enable_prefix_caching=False)
eng = llm.engine
acc = defaultdict(float)
def wrap(obj, name, key):
    orig = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter()
        try: return orig(*a, **k)
        finally: acc[key] += time.perf_counter() - t
    setattr(obj, name, w)
wrap(eng, "_schedule", "schedule")
wrap(eng, "_build", "build")
wrap(eng, "_apply", "apply")
wrap(eng.scheduler, "update_from_output", "  update")
wrap(eng.output_processor, "outputs_for", "outputs_for")
wrap(eng.executor.runner, "execute", "execute")
wrap(eng.executor.runner, "prepare_inputs", "  prepare")
wrap(eng.executor.runner, "update_states", "  update_states")
wrap(eng.executor.runner.model, "decode_round", "  native")
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
rows = defaultdict(list); steps = []
for it in range(int(sys.argv[2])):
    eng.add_request(None, [rng.randrange(100, 20000) for _ in range(256)], sp)
    while eng.has_unfinished_requests():
        acc.clear()
        t = time.perf_counter(); eng.step(); dt = time.perf_counter() - t
        if eng.counters.step_history[-1].num_prefill_tokens == 0:
            steps.append(dt)
            for k, v in acc.items(): rows[k].append(v)
print("step median %.3f ms" % (statistics.median(steps) * 1e3))
for k, v in rows.items(): print("  %-16s %.3f ms" % (k, statistics.median(v) * 1e3))
