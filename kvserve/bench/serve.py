"""``kvserve bench serve``: an online load generator for any OpenAI-compatible server.

Requests arrive as a Poisson process at ``request_rate`` per second (``inf``: all at once),
each a streaming completion; the client stamps every streamed chunk, so TTFT, TPOT, ITL and
end-to-end latency are what a user of that server would see.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx
from tqdm import tqdm

from kvserve.bench.timing import distribution
from kvserve.bench.workloads import Workload

WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city").split()


@dataclass
class ServeOptions:
    url: str
    model: Optional[str] = None  # None: the first id in GET /v1/models
    request_rate: float = math.inf
    max_concurrency: Optional[int] = None
    endpoint: str = "completions"  # completions | chat
    prompt_kind: str = "tokens"  # tokens (ids; completions only) | text
    api_key: Optional[str] = None
    ignore_eos: bool = True  # sent as the vLLM-style extension; other servers may ignore it
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    timeout_s: float = 600.0
    seed: int = 0
    progress: bool = True


@dataclass
class StreamResult:
    prompt_len: int
    start: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0  # from usage when the server reports it, else the chunk count
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> Optional[float]:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> Optional[float]:
        return self.chunk_times[-1] - self.start if self.chunk_times else None

    @property
    def tpot(self) -> Optional[float]:
        if self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def text_prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def request_body(opts: ServeOptions, model: str, prompt_ids: list[int], max_tokens: int,
                 rng: random.Random) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text_prompt(rng, len(prompt_ids))}]
    elif opts.prompt_kind == "text":
        body["prompt"] = text_prompt(rng, len(prompt_ids))
    else:
        body["prompt"] = prompt_ids
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c.get("text") or ""
    return (c.get("delta") or {}).get("content") or ""


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
                      result: StreamResult) -> None:
    n_chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = str(chunk["error"])[:200]
                    return
                now = time.perf_counter()
                # Chunks without text (a chat role header, the usage tail) carry no token.
                if _chunk_text(chunk):
                    result.chunk_times.append(now)
                    n_chunks += 1
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens"):
                    result.output_tokens = int(usage["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return
    if not result.output_tokens:
        result.output_tokens = n_chunks


async def _discover_model(client: httpx.AsyncClient, base: str, headers: dict) -> str:
    resp = await client.get(f"{base}/models", headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base}/models lists no model; pass --served-model")
    return data[0]["id"]


async def run_load(workload: Workload, opts: ServeOptions) -> tuple[list[StreamResult], float, str]:
    """Fire the workload at the server; returns per-request results, wall time and model."""
    base = base_url(opts.url)
    url = f"{base}/chat/completions" if opts.endpoint == "chat" else f"{base}/completions"
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    rng = random.Random(opts.seed)
    limits = httpx.Limits(max_connections=opts.max_concurrency or workload.num_requests + 1)
    semaphore = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    async with httpx.AsyncClient(timeout=opts.timeout_s, limits=limits) as client:
        model = opts.model or await _discover_model(client, base, headers)
        bodies = [request_body(opts, model, p, n, rng)
                  for p, n in zip(workload.prompts, workload.output_lens)]
        results = [StreamResult(prompt_len=len(p), start=0.0) for p in workload.prompts]
        bar = tqdm(total=len(bodies), desc="requests", unit="req", disable=not opts.progress,
                   leave=False)

        async def one(i: int) -> None:
            async def go() -> None:
                results[i].start = time.perf_counter()
                await _stream_one(client, url, bodies[i], headers, results[i])
                bar.update(1)
            if semaphore is None:
                await go()
            else:
                async with semaphore:
                    await go()

        tasks = []
        started = time.perf_counter()
        for i in range(len(bodies)):
            tasks.append(asyncio.create_task(one(i)))
            if math.isfinite(opts.request_rate) and i + 1 < len(bodies):
                await asyncio.sleep(rng.expovariate(opts.request_rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        bar.close()
    return results, elapsed, model


def summarize_serve(results: list[StreamResult], elapsed: float, opts: ServeOptions) -> dict:
    ok = [r for r in results if r.ok]
    n_out = sum(r.output_tokens for r in ok)
    n_in = sum(r.prompt_len for r in ok)

    def meets_slo(r: StreamResult) -> bool:
        if opts.slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1e3 > opts.slo_ttft_ms):
            return False
        if opts.slo_tpot_ms is not None and r.tpot is not None and r.tpot * 1e3 > opts.slo_tpot_ms:
            return False
        return True

    good = [r for r in ok if meets_slo(r)]
    elapsed = max(elapsed, 1e-9)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": elapsed,
        "num_prompt_tokens": n_in,
        "num_output_tokens": n_out,
        "request_throughput": len(ok) / elapsed,
        "output_token_throughput": n_out / elapsed,
        "total_token_throughput": (n_in + n_out) / elapsed,
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([r.tpot for r in ok]),
        "itl_ms": distribution([x for r in ok for x in r.itls]),
        "e2e_ms": distribution([r.e2e for r in ok]),
        "slo": {"ttft_ms": opts.slo_ttft_ms, "tpot_ms": opts.slo_tpot_ms},
        "goodput_requests_per_s": len(good) / elapsed,
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "per_request": [{"prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                         "ttft_ms": r.ttft and r.ttft * 1e3, "tpot_ms": r.tpot and r.tpot * 1e3,
                         "e2e_ms": r.e2e and r.e2e * 1e3, "error": r.error} for r in results],
    }


def run_serve(workload: Workload, opts: ServeOptions) -> tuple[dict, list[StreamResult]]:
    if opts.endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be completions or chat, not {opts.endpoint!r}")
    results, elapsed, model = asyncio.run(run_load(workload, opts))
    summary = summarize_serve(results, elapsed, opts)
    result = {"command": "serve", "url": opts.url, "served_model": model,
              "endpoint": opts.endpoint, "prompt_kind": opts.prompt_kind,
              "request_rate": opts.request_rate if math.isfinite(opts.request_rate) else "inf",
              "max_concurrency": opts.max_concurrency, "workload": workload.describe(), **summary}
    return result, results


def print_serve_summary(result: dict, file=None) -> None:
    file = file or sys.stdout

    def d(key: str) -> str:
        dist = result[key]
        if not dist["count"]:
            return "-"
        return f"mean {dist['mean']:.1f}, p50 {dist['p50']:.1f}, p99 {dist['p99']:.1f}"

    print(f"\n== serve: {result['url']} ({result['served_model']}), rate {result['request_rate']} req/s",
          file=file)
    print(f"completed {result['completed']}, failed {result['failed']} in {result['duration_s']:.2f} s",
          file=file)
    print(f"throughput: {result['request_throughput']:.2f} req/s, "
          f"{result['output_token_throughput']:.1f} output tok/s, "
          f"{result['total_token_throughput']:.1f} total tok/s", file=file)
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        print(f"{label:>5} ms: {d(key)}", file=file)
    slo = result["slo"]
    bounds = [f"{label}<={slo[key]:g} ms" for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))
              if slo[key] is not None]
    within = f"within SLO {', '.join(bounds)}" if bounds else "completed (no SLO given)"
    print(f"goodput: {result['goodput_requests_per_s']:.2f} req/s "
          f"({100 * result['slo_attainment']:.0f} % of requests {within})", file=file)
    for err in result["errors"]:
        print(f"  error: {err}", file=file)
