"""Soak: rounds of mixed requests against ``kvserve serve``; after each round, the server's
RSS, the KV blocks still held and the 5xx count (issue 16's bar: after the first round, RSS
grows by at most 2 % per round; 0 blocks held; 0 5xx).

The mix: plain and chat completions, streams read to the end or dropped after a chunk or
two, client timeouts, n > 1, stop strings, penalties and logit_bias, logprobs and echoed
prompt logprobs, structured outputs and tool calls, malformed bodies. Each round draws the
same mix with its own seed.

    python benchmarks/soak.py [--model smollm2-135m-instruct] [--rounds 4] [--requests 250]
        [--env MALLOC_ARENA_MAX=8]   # extra environment for the server (allocator experiments)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):",
           "Write a haiku about the sea.", "List three colors:", "Explain KV caches briefly."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"], "additionalProperties": False}}}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def request_of(rng: random.Random) -> tuple[str, str, object, dict]:
    """(kind, path, body, options): one request of the mix."""
    prompt = rng.choice(PROMPTS) + " " * rng.randrange(4)
    tokens = rng.randrange(4, 40)
    kind = rng.choices(["plain", "chat-stream", "dropped-stream", "timeout", "n", "penalties",
                        "logprobs", "structured", "tools", "malformed"],
                       weights=[20, 14, 10, 8, 10, 10, 6, 8, 5, 9])[0]
    sampling = {"temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randrange(1000)}
    if kind == "plain":
        return kind, "/v1/completions", {"prompt": prompt, "max_tokens": tokens, **sampling}, {}
    if kind in ("chat-stream", "dropped-stream"):
        body = {"messages": chat(prompt), "max_tokens": tokens, "stream": True,
                "stream_options": {"include_usage": True}, **sampling}
        return kind, "/v1/chat/completions", body, {"drop_after": rng.randrange(1, 3) if kind == "dropped-stream" else None}
    if kind == "timeout":
        body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": rng.random() < 0.5}
        return kind, "/v1/completions", body, {"timeout": rng.uniform(0.05, 0.5)}
    if kind == "n":
        body = {"prompt": prompt, "max_tokens": tokens, "n": rng.randrange(2, 5), "temperature": 0.8,
                "stop": rng.choice([["\n"], [".", "!"], "the"]), "seed": rng.randrange(1000)}
        return kind, "/v1/completions", body, {}
    if kind == "penalties":
        body = {"messages": chat(prompt), "max_tokens": tokens, "presence_penalty": rng.uniform(-1, 1),
                "frequency_penalty": rng.uniform(0, 1.5), "repetition_penalty": rng.uniform(1.0, 1.3),
                "logit_bias": {str(rng.randrange(1000)): rng.uniform(-5, 5)}, **sampling}
        return kind, "/v1/chat/completions", body, {}
    if kind == "logprobs":
        if rng.random() < 0.5:
            body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": rng.randrange(0, 5)}
            return kind, "/v1/completions", body, {}
        body = {"messages": chat(prompt), "max_tokens": tokens, "logprobs": True,
                "top_logprobs": rng.randrange(0, 6)}
        return kind, "/v1/chat/completions", body, {}
    if kind == "structured":
        fmt = rng.choice([{"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
                          {"response_format": {"type": "json_object"}},
                          {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                          {"structured_outputs": {"regex": "[0-9]{1,4}"}}])
        return kind, "/v1/chat/completions", {"messages": chat(prompt), "max_tokens": 48, **fmt}, {}
    if kind == "tools":
        body = {"messages": chat("Weather in Paris?"), "max_tokens": 48, "tools": [TOOL],
                "tool_choice": rng.choice(["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])}
        return kind, "/v1/chat/completions", body, {}
    return kind, "/v1/completions", rng.choice([
        b'{"prompt": "unterminated', b'[1, 2, 3]', {"prompt": ""}, {"prompt": "hi", "max_tokens": "x"},
        {"prompt": "hi", "n": 0}, {"model": "nope", "prompt": "hi"}, {"prompt": [[]]},
        {"prompt": "hi", "temperature": -1}, {"prompt": "hi", "structured_outputs": {"regex": "("}}]), {}


async def send(http: httpx.AsyncClient, kind: str, path: str, body, options: dict) -> int:
    """The status code (0: the client gave up, as meant, or dropped the stream)."""
    kwargs = ({"content": body, "headers": {"content-type": "application/json"}}
              if isinstance(body, bytes) else {"json": body})
    timeout = options.get("timeout")
    try:
        if isinstance(body, dict) and body.get("stream"):
            async with http.stream("POST", path, timeout=timeout or 300, **kwargs) as resp:
                chunks = 0
                async for line in resp.aiter_lines():
                    if '"server_error"' in line:
                        return 500
                    chunks += line.startswith("data: ")
                    if options.get("drop_after") and chunks >= options["drop_after"]:
                        return 0
                return resp.status_code
        resp = await http.post(path, timeout=timeout or 300, **kwargs)
        return resp.status_code
    except httpx.TimeoutException:
        return 0


async def run_round(url: str, seed: int, num_requests: int, concurrency: int) -> dict[int, int]:
    rng = random.Random(seed)
    jobs = [request_of(rng) for _ in range(num_requests)]
    codes: dict[int, int] = {}
    sem = asyncio.Semaphore(concurrency)

    async def one(job) -> None:
        async with sem:
            code = await send(http, *job)
            codes[code] = codes.get(code, 0) + 1

    async with httpx.AsyncClient(base_url=url) as http:
        await asyncio.gather(*(one(job) for job in jobs))
    return codes


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=250)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="24M")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    args = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **dict(kv.split("=", 1) for kv in args.env)}
    log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-soak-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", args.model,
                             "--port", str(port), "--kv-cache-memory", args.kv_cache_memory,
                             "--max-model-len", "1024", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        print(f"model {args.model}, --kv-cache-memory {args.kv_cache_memory}, env {args.env or 'default'}; "
              f"{args.rounds} rounds of {args.requests} requests, {args.concurrency} at a time")
        print(f"round 0 (idle): RSS {rss_mib(proc.pid):,.0f} MiB")
        previous = None
        for r in range(1, args.rounds + 1):
            t0 = time.monotonic()
            codes = asyncio.run(run_round(url, r, args.requests, args.concurrency))
            time.sleep(2)  # dropped streams and timed-out requests are aborted by now
            rss = rss_mib(proc.pid)
            blocks = metric(url, "kvserve:kv_cache_blocks_used")
            server_errors = sum(n for code, n in codes.items() if code >= 500)
            growth = f", {100 * (rss / previous - 1):+.1f} %" if previous else ""
            print(f"round {r}: RSS {rss:,.0f} MiB{growth}; blocks held {blocks:.0f}; "
                  f"5xx {server_errors}; statuses {dict(sorted(codes.items()))}; "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            previous = rss
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        print(f"server log: {log.name}")


if __name__ == "__main__":
    main()
