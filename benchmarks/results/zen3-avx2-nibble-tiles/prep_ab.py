# In one process: an older ModelRunner.prepare_inputs (argv[1], e.g. `git show 419c812:kvserve/runner.py
# > /tmp/runner_old.py`) against this tree's, on the same captured single-stream decode step (SmolLM2
# int4), alternated, each call after a 64 MB write floods the caches (as a step's weights do).
# Usage: python prep_ab.py /tmp/runner_old.py
import sys, time, statistics, copy, importlib.util, types
import torch
from kvserve.llm import LLM
from kvserve.request import SamplingParams
import kvserve.runner as runner_mod
spec = importlib.util.spec_from_file_location("kvserve.runner_old", sys.argv[1])
old_mod = importlib.util.module_from_spec(spec); sys.modules["kvserve.runner_old"] = old_mod; spec.loader.exec_module(old_mod)
llm = LLM("smollm2-135m-instruct", quantization="int4", enable_prefix_caching=False)
runner = llm.engine.executor.runner
captured = []
orig = runner.prepare_inputs
def cap(step):
    if len(step.chunks) == 1 and not step.chunks[0].is_prefill and not captured:
        captured.append(copy.deepcopy(step))
    return orig(step)
runner.prepare_inputs = cap
llm.generate([list(range(100, 356))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
step = captured[0]
new_fn = types.MethodType(runner_mod.ModelRunner.prepare_inputs, runner)
old_fn = types.MethodType(old_mod.ModelRunner.prepare_inputs, runner)
a, b = new_fn(step), old_fn(step)
for f in ("input_ids", "positions", "logits_indices"):
    assert torch.equal(getattr(a, f), getattr(b, f)), f
for f in ("slot_mapping", "block_tables", "seq_lens_tensor", "query_start_loc_tensor"):
    assert torch.equal(getattr(a.attn_metadata, f), getattr(b.attn_metadata, f)), f
junk = torch.empty(64 << 20, dtype=torch.uint8)
t = {"old": [], "new": []}
for i in range(400):
    for name, fn in (("old", old_fn), ("new", new_fn)) if i % 2 == 0 else (("new", new_fn), ("old", old_fn)):
        junk.add_(1)
        t0 = time.perf_counter(); fn(step); t[name].append(time.perf_counter() - t0)
for k, v in t.items():
    print(k, "prepare_inputs after a cache flood: median %.1f us" % (statistics.median(v) * 1e6))
print("old/new %.2fx" % (statistics.median(t["old"]) / statistics.median(t["new"])))
