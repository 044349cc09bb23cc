"""The installed extension's w8a8_linear_out against builds of other w8a8_linear.cpp sources
(each SRC a folder with w8a8_linear.cpp and .h, step_team.cpp and .h, linear_args.h,
row_dispatch.h, avx2_reduce.h and bind.cpp binding w8a8_linear_out), built under their own module
names and alternated call by call (each first in turn), on the real activations of
capture_activations.py, each layer's largest_codes passed as the engine passes them; per layer
kind the sum over layers of each way's minimum of REPS calls.

    REPS=11 python w8a8_ab.py smollm2-135m-instruct|gemma-3-270m SRC [SRC ...]
"""
import os, sys, time, tempfile, hashlib, torch
from torch.utils.cpp_extension import load
from kvserve import ops
name = sys.argv[1]; srcs = [s.rstrip("/") + "/" for s in sys.argv[2:]]
reps = int(os.environ.get("REPS", "9"))
mods = {"installed": ops.load_extension()}
for src in srcs:
    bd = "/tmp/w8dev/build_" + hashlib.md5(src.encode()).hexdigest()[:8]; os.makedirs(bd, exist_ok=True)
    mods[os.path.basename(src.rstrip("/"))] = load(name="w8dev_" + hashlib.md5(src.encode()).hexdigest()[:8], sources=[src + n for n in ["bind.cpp", "w8a8_linear.cpp", "step_team.cpp"]],
           build_directory=bd, extra_cflags=["-O3", "-march=" + os.environ.get("KVSERVE_CPU_MARCH", "native"), "-fopenmp", "-fopenmp-simd", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"],
           extra_ldflags=["-fopenmp"], verbose=False)
layers = [L for L in torch.load(f"/tmp/w8dev/{name}.pt") if L["x"] is not None]
for L in layers: L["lc"] = L["weight"].reshape(L["weight"].shape[0], -1).amax(1).contiguous()
names = list(mods)
tot = {m: 0.0 for m in names}
kinds = {}
for L in layers: kinds.setdefault(L["name"].split(".")[-1], []).append(L)
for k, Ls in kinds.items():
    t = {m: 0.0 for m in names}
    for L in Ls:
        x = L["x"].float().contiguous(); out = torch.empty(x.shape[0], L["n"])
        best = {m: 1e9 for m in names}
        for i in range(reps):
            order = names[i % len(names):] + names[:i % len(names)]
            for m in order:
                s = time.perf_counter(); mods[m].w8a8_linear_out(out, x, L["weight"], L["affine"], L["bias"], L["lc"]); best[m] = min(best[m], time.perf_counter() - s)
        for m in names: t[m] += best[m] * 1e3
    for m in names: tot[m] += t[m]
    print(f"{k:14s}", "  ".join(f"{m} {t[m]:.1f}" for m in names))
print("total", "  ".join(f"{m} {tot[m]:.1f} ({tot[m]/tot['installed']:.3f}x)" for m in names))
