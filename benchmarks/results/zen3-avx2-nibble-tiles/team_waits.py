# The step team leader's own and waiting time per parallel call site (rdtsc cycles), on a tree with
# team_waits.patch applied (PYTHONPATH=<that tree> TORCH_EXTENSIONS_DIR=<its own directory>).
# Usage: python team_waits.py MODEL
import sys, subprocess, bisect
from kvserve import ops
from kvserve.llm import LLM
from kvserve.request import SamplingParams
ext = ops.load_extension()
llm = LLM(sys.argv[1], quantization="int4", enable_prefix_caching=False)
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
llm.generate([list(range(100, 228))], sp)
ext.team_waits_clear()
for i in range(3):
    llm.generate([list(range(200 + i, 328 + i))], sp)
waits = ext.team_waits()
so = ext.__file__
base = None
for line in open("/proc/self/maps"):
    if so in line and " 00000000 " in line:
        base = int(line.split("-")[0], 16); break
syms = []
for line in subprocess.run(["nm", "-C", "--defined-only", so], capture_output=True, text=True).stdout.splitlines():
    parts = line.split(" ", 2)
    if len(parts) == 3 and parts[1] in "tTwW":
        syms.append((int(parts[0], 16), parts[2]))
syms.sort()
addrs = [a for a, _ in syms]
tot_own = sum(w[2] for w in waits); tot_wait = sum(w[3] for w in waits)
print("total leader cycles in team calls: own %.1f M, waiting %.1f M (%.1f %% of them waiting); steps %d" % (tot_own / 1e6, tot_wait / 1e6, 100 * tot_wait / (tot_own + tot_wait), 3 * 128))
for addr, calls, own, wait in sorted(waits, key=lambda w: -w[3])[:14]:
    off = addr - base
    i = bisect.bisect_right(addrs, off) - 1
    name = syms[i][1] if i >= 0 else "?"
    print("%7d calls  own %8.1f  wait %8.1f kcycles/step  wait/own %.2f  %s" % (calls, own / 384 / 1e3, wait / 384 / 1e3, wait / max(own, 1), name[:150]))
