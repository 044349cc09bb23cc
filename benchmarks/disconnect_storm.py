"""Issue 66's disconnect storm against a real server: 20 streams, each closed after 5 chunks, one
opened every 0.5 s, while /health and /metrics are polled; prints their worst latency and how
many tokens each closed request generated after its close (from the server's own counters)::

    python benchmarks/disconnect_storm.py --model gemma-3-270m

Bar: /health worst <= 100 ms; tokens after each close <= the tokens of one step.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--interval", type=float, default=0.5)
    ns = ap.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", ns.model, "--port", str(port),
                               "--kv-cache-memory", "256MiB"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        worst = {"/health": 0.0, "/metrics": 0.0}
        samples = {"/health": []}
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(timeout=30) as http:
                while not stop.is_set():
                    for path in worst:
                        t0 = time.monotonic()
                        http.get(url + path)
                        dt = time.monotonic() - t0
                        worst[path] = max(worst[path], dt)
                        if path in samples:
                            samples[path].append(dt)
                    time.sleep(0.01)

        body = {"model": ns.model, "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 400,
                "ignore_eos": True, "stream": True, "temperature": 0.8}
        def one_stream() -> None:
            with httpx.Client(timeout=60) as http:
                with http.stream("POST", url + "/v1/completions", json=body) as resp:
                    chunks = 0
                    for line in resp.iter_lines():
                        chunks += line.startswith("data: ") and line != "data: [DONE]"
                        if chunks == ns.chunks:
                            break  # closes the stream

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        threads = []
        start_tokens = _generated(httpx.Client(timeout=30), url)
        for _ in range(ns.streams):
            t = threading.Thread(target=one_stream)
            t.start()
            threads.append(t)
            time.sleep(ns.interval)
        for t in threads:
            t.join()
        time.sleep(1.0)
        stop.set()
        poller.join()
        total = _generated(httpx.Client(timeout=30), url) - start_tokens
        health = sorted(samples["/health"])
        print(f"model {ns.model}: {ns.streams} streams closed after {ns.chunks} chunks, one every {ns.interval} s")
        print(f"/health worst {1e3 * worst['/health']:.1f} ms (p50 {1e3 * health[len(health) // 2]:.1f}, "
              f"{len(health)} polls); /metrics worst {1e3 * worst['/metrics']:.1f} ms")
        print(f"tokens generated in all: {total}; read by the clients: {ns.streams * ns.chunks}; "
              f"after the closes: {total - ns.streams * ns.chunks} "
              f"({(total - ns.streams * ns.chunks) / ns.streams:.1f} per stream)")
        print(json.dumps({"health_worst_ms": 1e3 * worst["/health"], "metrics_worst_ms": 1e3 * worst["/metrics"],
                          "tokens_after_close_per_stream": (total - ns.streams * ns.chunks) / ns.streams}))
    finally:
        server.terminate()
        server.wait(timeout=60)


def _generated(http: httpx.Client, url: str) -> int:
    for line in http.get(url + "/metrics").text.splitlines():
        if line.startswith("kvserve:generation_tokens_total"):
            return int(float(line.split()[-1]))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
