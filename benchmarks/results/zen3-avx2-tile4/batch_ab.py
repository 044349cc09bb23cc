"""Batched greedy decoding, SmolLM2 default weights: B requests of 64 prompt tokens, 64 tokens
each, best of 3 (run once per build, alternated; the first line names the kvserve it ran)."""
import time

from kvserve.llm import LLM
from kvserve.request import SamplingParams
import kvserve
llm = LLM("smollm2-135m-instruct", enable_prefix_caching=False)
out = []
for B in [5, 10, 11, 16]:
    prompts = [list(range(1000 + 64 * i, 1064 + 64 * i)) for i in range(B)]
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    ts = []
    for r in range(3):
        t = time.perf_counter(); llm.generate(prompts, sp); ts.append(time.perf_counter() - t)
    out.append("B=%d %.1f tok/s" % (B, B * 64 / min(ts)))
print(kvserve.__file__, " | ".join(out))
