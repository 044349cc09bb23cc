"""Disaggregated serving over real HTTP: a prefill and a decode instance (`kvserve serve
--disaggregation-mode ...` processes, TCP connector over loopback) behind the router.

The decode instance serves ordinary requests too, on its own engine: that is the colocated
reference the routed answers are compared with. Then the faults: a prefill instance that hangs
(SIGSTOP) or dies (SIGKILL) under load fails its requests with a clear error within seconds,
never a hang, and the decode side stays healthy with no block held."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from test_server import ServerThread, scrape
from kvserve.disagg.router import RouterConfig, create_router_app

ENGINE = ["--model", "tiny-llama", "--max-model-len", "512", "--num-blocks", "300", "--dtype", "float32",
          "--kv-connector", "tcp", "--log-level", "warning"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(role: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", *ENGINE, "--disaggregation-mode", role,
                             "--port", str(port), "--kv-load-timeout", "5"], env=env)
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} not ready")


@pytest.fixture(scope="module")
def deployment():
    procs = {role: _start(role) for role in ("prefill", "decode")}
    try:
        for proc, url in procs.values():
            _wait_ready(proc, url)
        config = RouterConfig(prefill_urls=[procs["prefill"][1]], decode_urls=[procs["decode"][1]],
                              health_interval_s=0.5, health_timeout_s=1.0, unhealthy_after=3)
        with ServerThread(create_router_app(config)) as router:
            yield {"router": router.url, "prefill": procs["prefill"], "decode": procs["decode"]}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=30)


def _chat(url: str, content: str, stream: bool, max_tokens: int = 12, timeout: float = 60.0) -> tuple[int, str]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
        return r.status_code, (r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text)
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 500, chunk["error"]["message"]
                text += chunk["choices"][0]["delta"].get("content") or "" if chunk["choices"] else ""
    return 200, text


def test_routed_answers_match_colocated_and_metrics_show_the_transfers(deployment):
    router, decode_url = deployment["router"], deployment["decode"][1]
    for i, content in enumerate(["Tell me about the sea.", "What is a cat? " * 20]):
        reference = _chat(decode_url, content, stream=False)  # the decode engine on its own
        assert reference[0] == 200
        assert _chat(router, content, stream=bool(i % 2)) == reference
        assert _chat(router, content, stream=not i % 2) == reference
    decode, prefill = scrape(decode_url), scrape(deployment["prefill"][1])
    assert decode["kvserve:kv_transfers_loaded_total"] >= 3
    assert decode["kvserve:kv_transfer_received_bytes_total"] > 0
    assert decode["kvserve:kv_transfer_load_seconds_count"] == decode["kvserve:kv_transfers_loaded_total"]
    assert prefill["kvserve:kv_transfers_published_total"] >= 4
    # Each request's second send reused the decode side's prefix cache (the first's blocks).
    assert decode["kvserve:kv_transfer_reused_blocks_total"] > 0
    assert decode["kvserve:kv_cache_blocks_used"] == 0
    assert prefill["kvserve:kv_cache_blocks_used"] == 0 and prefill["kvserve:kv_transfers_staged"] == 0


def test_a_client_gone_mid_stream_frees_both_sides(deployment):
    router, decode_url = deployment["router"], deployment["decode"][1]
    prefill_url = deployment["prefill"][1]
    body = {"messages": [{"role": "user", "content": "Go on and on. " * 20}], "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # the first token: leave
    deadline = time.monotonic() + 10
    while True:
        decode, prefill = scrape(decode_url), scrape(prefill_url)
        if (decode["kvserve:kv_cache_blocks_used"] == 0 and decode["kvserve:num_requests_running"] == 0
                and decode["kvserve:kv_transfers_in_flight"] == 0 and prefill["kvserve:kv_cache_blocks_used"] == 0
                and prefill["kvserve:kv_transfers_staged"] == 0):
            break
        assert time.monotonic() < deadline, (decode, prefill)
        time.sleep(0.2)
    assert decode["kvserve:request_aborted_total"] >= 1


def _load(router: str, n: int) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(n)
    futures = [pool.submit(_chat, router, f"Story number {i}: " + "once upon a time " * 30, bool(i % 2), 40)
               for i in range(n)]
    pool.shutdown(wait=False)
    return futures


def test_a_hung_prefill_instance_fails_its_requests_within_seconds(deployment):
    router = deployment["router"]
    proc, url = deployment["prefill"]
    futures = _load(router, 6)
    time.sleep(0.3)
    proc.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        results = [f.result(timeout=30) for f in futures]
        assert time.monotonic() - t0 < 15
        failed = [r for r in results if r[0] != 200]
        assert all(r[0] == 503 and "prefill" in r[1] for r in failed), failed
        status, message = _chat(router, "hello", stream=False)
        assert status == 503 and "prefill" in message
    finally:
        proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 20  # the router takes it back once it answers again
    while _chat(router, "hello again", stream=False)[0] != 200:
        assert time.monotonic() < deadline, "the prefill instance did not come back"
        time.sleep(0.5)


def test_a_killed_prefill_instance_fails_fast_and_the_decode_side_stays_healthy(deployment):
    router = deployment["router"]
    proc, _ = deployment["prefill"]
    decode_proc, decode_url = deployment["decode"]
    futures = _load(router, 8)
    time.sleep(0.5)
    proc.kill()
    t0 = time.monotonic()
    results = [f.result(timeout=30) for f in futures]
    assert time.monotonic() - t0 < 15
    for status, text in results:
        assert status == 200 or (status in (500, 503) and "prefill" in text), (status, text)
    status, message = _chat(router, "hello", stream=True)
    assert status == 503 and "prefill" in message
    # The decode side: alive, serving, nothing held.
    assert decode_proc.poll() is None and httpx.get(decode_url + "/health").status_code == 200
    assert _chat(decode_url, "still there?", stream=False)[0] == 200
    deadline = time.monotonic() + 10
    while scrape(decode_url)["kvserve:kv_cache_blocks_used"] or scrape(decode_url)["kvserve:kv_transfers_in_flight"]:
        assert time.monotonic() < deadline, "blocks held on the decode side"
        time.sleep(0.2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1")
def test_serve_disaggregate_is_one_command():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", "tiny-llama",
                             "--max-model-len", "512", "--num-blocks", "200", "--log-level", "warning",
                             "--disaggregate", "--prefill-cpus", "0", "--decode-cpus", "1", "--port", str(port)],
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url)
        instances = {i["role"]: i["url"] for i in httpx.get(url + "/health").json()["instances"]}
        reference = _chat(instances["decode"], "Hi there", stream=False)
        assert _chat(url, "Hi there", stream=True) == reference
        assert scrape(instances["decode"])["kvserve:kv_transfers_loaded_total"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    for instance in instances.values():  # the launcher stopped its instances
        with pytest.raises(httpx.HTTPError):
            httpx.get(instance + "/health", timeout=2)

