"""Prefill/decode disaggregation on one host (issue 65's bar): the short streams' inter-token
latency under a mixed load, 1 core prefill + 1 core decode (`kvserve serve --disaggregate
--prefill-cpus 0 --decode-cpus 1`) against one colocated server on both cores.

Load, the same for both: ``--chats`` clients each streaming short chats back to back (a
one-line question, ``--chat-tokens`` greedy tokens), and a ``--long-tokens``-token prompt
(random token ids, a fresh prefix each time: no prefix-cache help) every ``--long-every``
seconds. Printed: the short streams' inter-token latency p50/p99 (gaps between successive
streamed tokens, the first excluded), the long prompts' time to answer, and the KV blocks and
staged transfers every instance holds once the load is over.

    python benchmarks/disagg_itl.py --model smollm2-135m-instruct --seconds 60
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def start(mode: str, model: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", *extra]
    if mode == "disaggregated":
        cmd += ["--disaggregate", "--prefill-cpus", "0", "--decode-cpus", "1"]
    else:
        cmd += ["--num-threads", "2"]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": os.getcwd()})


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("server not ready")


def chat_client(url: str, stop: threading.Event, gaps: list, errors: list, max_tokens: int, index: int) -> None:
    n = 0
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            n += 1
            body = {"messages": [{"role": "user", "content": f"Question {index}.{n}: name a color and say why."}],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            last = None
            try:
                with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(r.status_code)
                        continue
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)


def long_prompts(url: str, stop: threading.Event, every_s: float, num_tokens: int, latencies: list,
                 errors: list) -> None:
    rng = random.Random(0)
    threads = []

    def one(prompt: list[int]) -> None:
        t0 = time.perf_counter()
        try:
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                        "ignore_eos": True}, timeout=600)
            if r.status_code == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                errors.append(r.status_code)
        except httpx.HTTPError as exc:
            errors.append(type(exc).__name__)

    while not stop.wait(every_s if threads else 0.5):
        t = threading.Thread(target=one, args=([rng.randrange(100, 40000) for _ in range(num_tokens)],))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


def blocks_held(url: str, mode: str) -> dict:
    urls = {"server": url}
    if mode == "disaggregated":
        urls = {i["role"]: i["url"] for i in httpx.get(url + "/health").json()["instances"]}
    out = {}
    for role, u in urls.items():
        text = httpx.get(u + "/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line and not line.startswith("#")}
        out[role] = {k: values.get("kvserve:" + k, 0.0) for k in
                     ("kv_cache_blocks_used", "num_requests_running", "kv_transfers_staged", "kv_transfers_in_flight",
                      "kv_transfers_loaded_total", "kv_transfer_received_bytes_total")}
    return out


def run(mode: str, args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(mode, args.model, port, args.server_arg)
    try:
        wait_ready(url, proc)
        # Warm-up: one chat and one long prompt (page in the weights, build the kernels' state).
        httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 4}, timeout=300)
        httpx.post(url + "/v1/completions", json={"prompt": [5] * args.long_tokens, "max_tokens": 2}, timeout=600)
        stop = threading.Event()
        gaps, errors, long_latencies = [], [], []
        threads = [threading.Thread(target=chat_client, args=(url, stop, gaps, errors, args.chat_tokens, i))
                   for i in range(args.chats)]
        threads.append(threading.Thread(target=long_prompts, args=(url, stop, args.long_every, args.long_tokens,
                                                                   long_latencies, errors)))
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join()
        time.sleep(2)  # let the last transfers' staging be noticed gone
        held = blocks_held(url, mode)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    q = statistics.quantiles(gaps, n=100) if len(gaps) > 100 else [float("nan")] * 99
    return {"mode": mode, "itl_p50_ms": 1000 * q[49], "itl_p99_ms": 1000 * q[98], "itl_samples": len(gaps),
            "long_prompts": len(long_latencies),
            "long_latency_p50_s": statistics.median(long_latencies) if long_latencies else float("nan"),
            "errors": errors, "held_after": held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--chat-tokens", type=int, default=48)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--long-every", type=float, default=2.0)
    parser.add_argument("--modes", default="colocated,disaggregated")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `kvserve serve` flag (repeatable)")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; model {args.model}; {args.chats} chat streams of "
          f"{args.chat_tokens} tokens, a {args.long_tokens}-token prompt every {args.long_every} s, {args.seconds} s",
          flush=True)
    results = [run(mode, args) for mode in args.modes.split(",")]
    for r in results:
        print(json.dumps(r))
    by_mode = {r["mode"]: r for r in results}
    if len(by_mode) == 2:
        ratio = by_mode["disaggregated"]["itl_p99_ms"] / by_mode["colocated"]["itl_p99_ms"]
        print(f"ITL p99 disaggregated / colocated = {ratio:.2f} (bar: <= 0.5)")


if __name__ == "__main__":
    main()
