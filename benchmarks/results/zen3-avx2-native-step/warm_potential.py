# How much faster is a native decode step when the first N MB of its weights were read just before?
# (Tried, not kept: reading the first N MB of weights just before a step made it slower, not faster.)
# Usage: python warm_potential.py MODEL ROUNDS
import sys, time, random, statistics, torch
from kvserve.llm import LLM
from kvserve.request import SamplingParams
llm = LLM(sys.argv[1], quantization="int4", enable_prefix_caching=False)
eng = llm.engine; runner = eng.executor.runner; model = runner.model
bufs = []
for layer in model.model.layers:
    for name, b in layer.named_buffers():
        if b.numel() * b.element_size() > 4096 and "prefill" not in name: bufs.append(b)
print("layer buffers", len(bufs), "MB", sum(b.numel() * b.element_size() for b in bufs) / 1e6)
def first_bytes(mb):
    out, tot = [], 0
    for b in bufs:
        if tot >= mb * 1e6: break
        out.append(b.view(torch.uint8).view(-1) if b.dtype != torch.uint8 else b.view(-1)); tot += out[-1].numel()
    return out
orig = model.decode_round
cur = {"mb": 0}; times = []
def timed(*a, **k):
    if cur["mb"]:
        for t in first_bytes(cur["mb"]): t.sum()
    t0 = time.perf_counter(); r = orig(*a, **k); times.append(time.perf_counter() - t0); return r
model.decode_round = timed
sp = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
res = {}
for i in range(int(sys.argv[2])):
    prompt = [rng.randrange(100, 20000) for _ in range(128)]
    for mb in ([0, 4, 8, 16] if i % 2 == 0 else [16, 8, 4, 0]):
        cur["mb"] = mb; times.clear()
        llm.generate([prompt], sp)
        res.setdefault(mb, []).append(statistics.median(times[2:]) * 1e3)
for mb, v in res.items():
    print("first %2d MB warm: native step median %.3f ms" % (mb, statistics.median(v)))
