"""Real-size GGUF models against llama.cpp on the same file: peak memory, load time, TTFT, TPOT.

Each engine runs in a fresh process (peak RSS is the process's VmHWM, file pages it mapped
included), on the same file and the same prompt token ids, greedy, EOS ignored; the page cache is
warmed by one read of the file first. The files are the synthetic real-shape ones
(kvserve.loader.synthetic, quantized by llama.cpp's own quantizer where it is installed)::

    python benchmarks/real_size.py --model synthetic:llama-1b:Q4_K_M
    python benchmarks/real_size.py --model synthetic:llama-8b:Q4_K_M --engines kvserve
    python benchmarks/real_size.py --engines kvserve,kvserve-int8,llamacpp   # + the int8 prompt path

It prints one row per engine and the bars of issue 61 (peak RSS <= 1.3 x file + KV pool + 400 MiB,
load <= 3 s, TTFT <= 0.5x and TPOT <= 1.0x llama.cpp's), with the bytes a decode step reads per
token and the machine's plain read rate measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT_LEN, OUTPUT_LEN = 256, 64


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(1000, min(vocab, 30000)) for _ in range(n)]


def run_kvserve(path: str, kv_mib: int, iters: int, int4_prefill: str = "auto") -> dict:
    """kvserve's default; "kvserve-int8": prompt tokens on the int8 prompt path (--int4-prefill int8)."""
    t0 = time.perf_counter()
    from kvserve import LLM, SamplingParams
    imported = time.perf_counter()
    llm = LLM(path, kv_cache_memory=kv_mib << 20, max_model_len=2048, int4_prefill=int4_prefill)
    load = time.perf_counter() - imported
    engine = llm.engine
    ttfts, tpots = [], []
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    for i in range(iters + 1):
        ids = _prompt(engine.model_config.vocab_size, PROMPT_LEN, i)
        start = time.perf_counter()
        first = None
        for out in llm.stream({"prompt_token_ids": ids}, params):
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        if i:  # the first run warms up
            ttfts.append(first - start)
            tpots.append((end - first) / (OUTPUT_LEN - 1))
    return {"engine": "kvserve" if int4_prefill == "auto" else f"kvserve-{int4_prefill}", "load_s": load, "import_s": imported - t0, "ttft_ms": 1e3 * min(ttfts),
            "tpot_ms": 1e3 * min(tpots), "peak_rss_mib": _peak_rss_mib(), "weight_format": engine.weight_format}


def run_llamacpp(path: str, iters: int) -> dict:
    import llama_cpp
    import ctypes
    quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=os.cpu_count(), verbose=False,
                          logits_all=False)
    load = time.perf_counter() - t0
    ttfts, tpots = [], []
    for i in range(iters + 1):
        ids = _prompt(llm.n_vocab(), PROMPT_LEN, i)
        llm.reset()
        start = time.perf_counter()
        first, n = None, 0
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if n == OUTPUT_LEN:
                break
        end = time.perf_counter()
        if i:
            ttfts.append(first - start)
            tpots.append((end - first) / (OUTPUT_LEN - 1))
    return {"engine": "llamacpp", "load_s": load, "ttft_ms": 1e3 * min(ttfts), "tpot_ms": 1e3 * min(tpots),
            "peak_rss_mib": _peak_rss_mib()}


def read_rate_gbs(path: str) -> float:
    """The machine's plain read rate: a sum over a 512 MiB buffer (memory, not the file), 2 threads."""
    import torch
    x = torch.ones(128 << 20, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:llama-1b:Q4_K_M")
    ap.add_argument("--engines", default="kvserve,llamacpp")
    ap.add_argument("--kv-mib", type=int, default=256, help="kvserve's KV pool (--kv-cache-memory)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (the child process)
    ns = ap.parse_args()
    if ns.one:
        if ns.one.startswith("kvserve"):
            result = run_kvserve(ns.model, ns.kv_mib, ns.iters, ns.one.partition("-")[2] or "auto")
        else:
            result = run_llamacpp(ns.model, ns.iters)
        print("RESULT " + json.dumps(result))
        return
    from kvserve.cpu_features import cpu_info
    from kvserve.loader.resolve import resolve_model
    path = resolve_model(ns.model).path
    size_mib = os.path.getsize(path) / 2**20
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 << 20):
            pass
    info = cpu_info()
    print(f"cpu: {info}")
    print(f"model {ns.model}: {path} ({size_mib:.0f} MiB)")
    rows = []
    for engine in ns.engines.split(","):
        out = subprocess.run([sys.executable, __file__, "--model", path, "--kv-mib", str(ns.kv_mib), "--iters",
                              str(ns.iters), "--one", engine], capture_output=True, text=True)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode or not line:
            print(f"{engine}: failed\n{out.stderr[-2000:]}")
            continue
        rows.append(json.loads(line[0][7:]))
    rate = read_rate_gbs(path)
    print(f"plain read rate (2 threads): {rate:.1f} GB/s")
    print(f"{'engine':10} {'peak RSS MiB':>12} {'x file':>7} {'load s':>7} {'TTFT ms':>8} {'TPOT ms':>8}")
    for r in rows:
        print(f"{r['engine']:10} {r['peak_rss_mib']:12.0f} {r['peak_rss_mib'] / size_mib:7.2f} {r['load_s']:7.2f} "
              f"{r['ttft_ms']:8.1f} {r['tpot_ms']:8.1f}")
    by = {r["engine"]: r for r in rows}
    if "kvserve" in by:
        k = by["kvserve"]
        bar = 1.3 * size_mib + ns.kv_mib + 400
        print(f"kvserve ({k['weight_format']}): peak RSS {k['peak_rss_mib']:.0f} MiB vs bar {bar:.0f} "
              f"(1.3 x file + KV {ns.kv_mib} + 400): {'ok' if k['peak_rss_mib'] <= bar else 'MISS'}; "
              f"load {k['load_s']:.2f} s vs 3 s: {'ok' if k['load_s'] <= 3 else 'MISS'}")
    for name, k in by.items():
        if name.startswith("kvserve") and "llamacpp" in by:
            lc = by["llamacpp"]
            print(f"{name}: TTFT ratio {k['ttft_ms'] / lc['ttft_ms']:.2f}x (bar <= 0.5x), "
                  f"TPOT ratio {k['tpot_ms'] / lc['tpot_ms']:.2f}x (bar <= 1.0x)")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"model": ns.model, "file_mib": size_mib, "read_rate_gbs": rate, "cpu": info, "runs": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
