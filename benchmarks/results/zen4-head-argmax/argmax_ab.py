"""W2-like batched greedy decode (B requests of 64 prompt tokens): the LM head's argmax tokens
(argmax_tokens, no -inf rows) against its argmax-only logits and the sampler's argmax, alternated
request batch by request batch in one process (the model's forward patched to refuse tokens)."""
import statistics, sys, time
import torch
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.request import SamplingParams

model, batch, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
quant = sys.argv[4] if len(sys.argv) > 4 else None
engine = LLMEngine(EngineArgs(model=model, quantization=quant, enable_prefix_caching=False))
runner = engine.executor.runner
net = runner.model
original = net.forward
def without_tokens(*a, **k):
    k["argmax_tokens"] = False
    return original(*a, **k)
times = {"tokens": [], "logits": []}
outputs = {}
for r in range(rounds):
    for mode in (("tokens", "logits") if r % 2 == 0 else ("logits", "tokens")):
        net.forward = original if mode == "tokens" else without_tokens
        for i in range(batch):
            prompt = list(range(1000 + 64 * i + r, 1064 + 64 * i + r))
            engine.add_request(f"{mode}{r}-{i}", prompt, SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True))
        steps = []
        got = {}
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            if all(len(o.outputs[0].token_ids) > 1 for o in outs) and len(outs) == batch:
                steps.append(dt)
            for o in outs:
                if o.finished:
                    got[o.request_id.split("-")[1]] = o.outputs[0].token_ids
        times[mode].append(statistics.median(steps) * 1e3)
        outputs.setdefault(r, {})[mode] = got
same = all(v["tokens"] == v["logits"] for v in outputs.values())
print(f"{model} {quant or 'default'} batch {batch}: same tokens in both modes: {same}")
for m, v in times.items():
    print(f"  {m}: median step {statistics.median(v):.2f} ms (per round: {', '.join(f'{x:.1f}' for x in v)})")
print(f"  tokens / logits: {statistics.median(times['tokens']) / statistics.median(times['logits']):.3f}")
