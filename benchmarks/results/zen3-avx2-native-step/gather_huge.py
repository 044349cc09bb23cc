# The head's fp32 rescoring of 64 cold candidates (gathered_rows_dot) and the whole argmax call, with the
# exact table on 4 KB pages (as loaded) and on a huge-page copy, alternated. Usage: python gather_huge.py MODEL
import sys, time, torch, statistics
from kvserve.llm import LLM
from kvserve import ops
llm = LLM(sys.argv[1], quantization="int4", enable_prefix_caching=False)
head = llm.engine.executor.runner.model.lm_head; ext = ops.cpu_extension()
x = torch.randn(1, head.screen.in_features)
out, packed, exact, k = head.native_screen(1, x)
ext.q4_screen_linear_out(out, x, packed)
huge = ops.copy_to_huge_pages([exact])[0]
flood = torch.empty(96 << 20, dtype=torch.uint8)
tok = torch.empty(1, dtype=torch.int64)
ta, tb, tc, td = [], [], [], []
for i in range(300):
    idx = torch.randint(0, exact.shape[0], (1, 64))
    for w, acc in ((exact, ta), (huge, tb)) if i % 2 else ((huge, tb), (exact, ta)):
        flood.add_(1)
        a = time.perf_counter(); ext.gathered_rows_dot(x, w, idx); acc.append(time.perf_counter() - a)
    for w, acc in ((exact, tc), (huge, td)) if i % 2 else ((huge, td), (exact, tc)):
        flood.add_(1)
        a = time.perf_counter(); ext.screened_argmax_out(tok, out, x, packed, w, k); acc.append(time.perf_counter() - a)
m = lambda v: statistics.median(v) * 1e3
print("gather-dot: 4 KB %.3f ms, huge %.3f ms | whole argmax: 4 KB %.3f, huge %.3f ms" % (m(ta), m(tb), m(tc), m(td)))
