# 256 prompt rows through SmolLM2's / Gemma 3's int4 decoder layers: the AVX2 tiles (forward_blocks)
# against the bf16 prefill copies int4_prefill="auto" keeps on AVX2, alternated, 2 threads.
import sys, time, statistics, torch
from kvserve.llm import LLM
from kvserve.quant import Int4Linear, Q5Linear
llm = LLM(sys.argv[1], quantization="int4")
model = llm.engine.executor.runner.model
layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Q5Linear)) and getattr(m, "prefill", None) is not None]
xs = [torch.randn(256, l.in_features) for l in layers]
t = {"tiles": [], "bf16 copy": []}
with torch.inference_mode():
    for i in range(7):
        for name in ("tiles", "bf16 copy") if i % 2 == 0 else ("bf16 copy", "tiles"):
            t0 = time.perf_counter()
            for l, x in zip(layers, xs):
                (l.forward_blocks if name == "tiles" else l.prefill)(x)
            t[name].append(time.perf_counter() - t0)
print(sys.argv[1], len(layers), "layers, 256 rows:", {k: "%.1f ms" % (min(v) * 1e3) for k, v in t.items()},
      "tiles/copy %.2fx" % (min(t["tiles"]) / min(t["bf16 copy"])))
