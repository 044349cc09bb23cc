# The LM head's argmax path in parts, each call after a 96 MB flood: the screen, the whole call, top-k,
# the rescoring; then the screen against a torch sum of the same bytes. Usage: python head_parts.py MODEL
import sys, time, torch, statistics
from kvserve.llm import LLM
from kvserve import ops
llm = LLM(sys.argv[1], quantization="int4", enable_prefix_caching=False)
model = llm.engine.executor.runner.model
head = model.lm_head; ext = ops.cpu_extension()
x = torch.randn(1, head.screen.in_features)
out, packed, exact, k = head.native_screen(1, x)
flood = torch.empty(96 << 20, dtype=torch.uint8)
tok = torch.empty(1, dtype=torch.int64)
def t(fn, n=60):
    ts = []
    for _ in range(n):
        flood.add_(1)
        a = time.perf_counter(); fn(); ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e3
for r in range(3):
    a = t(lambda: ext.q4_screen_linear_out(out, x, packed))
    b = t(lambda: ext.screened_argmax_out(tok, out, x, packed, exact, k))
    c = t(lambda: ext.top_k_rows(out, k))
    idx = ext.top_k_rows(out, k)[1]
    d = t(lambda: ext.gathered_rows_dot(x, exact, idx))
    print("screen %.3f  whole argmax %.3f  top_k %.3f  gather-dot %.3f ms (each after a 96 MB flood)" % (a, b, c, d))
print("screen bytes %.1f MB" % (packed.numel() / 1e6))
buf = torch.empty(packed.numel() // 4, dtype=torch.float32)
for r in range(3):
    a = t(lambda: ext.q4_screen_linear_out(out, x, packed))
    s = t(lambda: buf.sum())
    print("screen %.3f ms (%.1f GB/s)   torch sum of the same bytes %.3f ms (%.1f GB/s)" % (a, packed.numel() / a / 1e6, s, packed.numel() / s / 1e6))
