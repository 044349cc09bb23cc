"""The screen at groups of 64 (this build) against groups of 32 (f6d8d76's screen_linear.cpp and
step_team.cpp, extracted to OLD_SRC beside a bind_screen.cpp that binds q4_screen_linear_out, and
built under another module name), alternated in one process with a 128 MB read before each call:
Gemma 3's / SmolLM2's head, output preallocated.

    python screen_ab.py gemma-3-270m|smollm2-135m-instruct OLD_SRC
"""
import statistics, sys, time
import torch
from torch.utils.cpp_extension import load
from kvserve import ops
from kvserve.loader import load_model, resolve_model
from kvserve.quant import Q4Screen, quantize_min_max, tile_nibbles
src = sys.argv[2].rstrip("/") + "/"
names = ["bind_screen.cpp", "screen_linear.cpp", "step_team.cpp"]
new = ops.load_extension()
old = load(name="kvserve_old_ops", sources=[src + n for n in names], build_directory=__import__("tempfile").mkdtemp(),
           extra_cflags=["-O3", "-march=" + __import__("os").environ.get("KVSERVE_CPU_MARCH", "native"), "-fopenmp", "-fopenmp-simd", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"],
           extra_ldflags=["-fopenmp"], verbose=False)
model_name = sys.argv[1]
model, config = load_model(resolve_model(model_name), dtype=torch.float32, quantization="bf16")
w = model.lm_head.exact_weight
n = w.shape[0]
new_packed = Q4Screen.from_float(w).packed
old_packed = tile_nibbles(*quantize_min_max(w))
evict = torch.ones(32 * 2**20)
for rows in (1, 8, 32):
    x = torch.randn(rows, w.shape[1])
    out = torch.empty(rows, n)
    t = {"groups of 32": [], "groups of 64": []}
    for i in range(25):
        for mode in (list(t) if i % 2 == 0 else list(t)[::-1]):
            evict.sum()
            s = time.perf_counter()
            if mode == "groups of 64":
                new.q4_screen_linear_out(out, x, new_packed)
            else:
                old.q4_screen_linear_out(out, x, old_packed)
            t[mode].append((time.perf_counter() - s) * 1e3)
    a, b = statistics.median(t["groups of 32"]), statistics.median(t["groups of 64"])
    print(f"{model_name} screen, {rows} rows: groups of 32 {a:.2f} ms (min {min(t['groups of 32']):.2f}), "
          f"groups of 64 {b:.2f} ms (min {min(t['groups of 64']):.2f}): {b / a:.3f}x", flush=True)
