# The screen's packed weights on 4 KB pages against a huge-page copy, alternated in one process. (Since
# cbca59d the screen loads on huge pages: its 4 KB copy is made here with clone(), malloc'd past THP's madvise.)
# Usage: python screen_huge.py MODEL
import sys, time, torch, statistics
from kvserve.llm import LLM
from kvserve import ops
llm = LLM(sys.argv[1], quantization="int4", enable_prefix_caching=False)
head = llm.engine.executor.runner.model.lm_head; ext = ops.cpu_extension()
x = torch.randn(1, head.screen.in_features)
out, packed, exact, k = head.native_screen(1, x)
huge = ops.copy_to_huge_pages([packed])[0]
packed = packed.clone()  # 4 KB pages (THP madvise mode)
flood = torch.empty(96 << 20, dtype=torch.uint8)
def t(p, n=40):
    ts = []
    for _ in range(n):
        flood.add_(1)
        a = time.perf_counter(); ext.q4_screen_linear_out(out, x, p); ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e3
ext.q4_screen_linear_out(out, x, packed); ref = out.clone(); ext.q4_screen_linear_out(out, x, huge); assert torch.equal(ref, out)
for r in range(4):
    a, b = t(packed), t(huge)
    print("4 KB pages %.3f ms   huge pages %.3f ms   (%.3fx)" % (a, b, a / b))
import re
def huge_kb(t):
    a = t.data_ptr(); cur = False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m: cur = int(m.group(1), 16) <= a < int(m.group(2), 16)
        elif cur and line.startswith("AnonHugePages"): return int(line.split()[1])
print("AnonHugePages of the mapping: loaded %d kB, copy %d kB" % (huge_kb(packed), huge_kb(huge)))
for r in range(4):
    b, a = t(huge), t(packed)
    print("huge pages %.3f ms   4 KB pages %.3f ms   (%.3fx)" % (b, a, a / b))
ta, tb = [], []
for i in range(300):
    for p, acc in (((packed, ta), (huge, tb)) if i % 2 else ((huge, tb), (packed, ta))):
        flood.add_(1)
        a = time.perf_counter(); ext.q4_screen_linear_out(out, x, p); acc.append(time.perf_counter() - a)
ratios = sorted(a / b for a, b in zip(ta, tb))
print("alternated per call x300: 4 KB median %.3f ms, huge median %.3f ms, median ratio %.3fx, quartiles %.3f-%.3f" % (
    statistics.median(ta) * 1e3, statistics.median(tb) * 1e3, ratios[150], ratios[75], ratios[225]))
