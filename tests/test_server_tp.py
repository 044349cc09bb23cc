"""The server on a tensor-parallel engine (2 worker processes): the same behaviour as on one
process (a subset of test_server's tests, run here against a TP=2 engine, fp32 on both
sides), and a worker killed mid-stream: the client gets an error, the server exits with a
clear message, no process is left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import psutil
import pytest

from conftest import track_engine
from kvserve.async_engine import AsyncLLMEngine
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.server.app import create_app
from test_server import (MAX_LEN, MODEL, ServerThread, _free_port, openai_client,  # noqa: F401
                         test_closing_a_stream_aborts_and_frees_blocks,
                         test_completion_matches_offline_streamed_or_not,
                         test_metrics_follow_the_requests)

TP_ARGS = dict(model=MODEL, max_model_len=MAX_LEN, dtype="float32")


def _wait_until_healthy(url: str, processes: list, timeout_s: float, message: str) -> None:
    """Poll ``/health`` until it answers 200; fail if a process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert all(p.poll() is None for p in processes) and time.monotonic() < deadline, message
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tiny():
    engine = LLMEngine(EngineArgs(**TP_ARGS, tensor_parallel_size=2, distributed_timeout_s=60))
    track_engine(engine)
    async_engine = AsyncLLMEngine(engine)
    try:
        with ServerThread(create_app(async_engine, MODEL)) as server:
            yield SimpleNamespace(url=server.url, engine=engine, async_engine=async_engine,
                                  client=openai_client(server.url))
    finally:
        async_engine.shutdown()
        # Every request the server saw is forgotten on every rank too (told with a step).
        from kvserve.batch import SchedulerOutput
        engine.executor.execute(engine.step_builder.build(SchedulerOutput()))
        assert all(s["num_requests"] == 0 for s in engine.executor.worker_stats())
        engine.shutdown()


@pytest.fixture(scope="module")
def offline(llm_factory):
    return llm_factory(**TP_ARGS)


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_stream_ends_the_server_cleanly(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", MODEL, "--dtype", "float32",
         "--tensor-parallel-size", "2", "--distributed-timeout", "5", "--port", str(port),
         "--max-model-len", str(MAX_LEN), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_until_healthy(url, [server], 90, "server did not start")
        workers = [p for p in psutil.Process(server.pid).children(recursive=True)
                   if "kvserve.executor.worker" in " ".join(p.cmdline())]
        assert len(workers) == 2
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_LEN - 16,
                "temperature": 0, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                try:
                    for line in resp.iter_lines():
                        lines.append(line)
                        if len(lines) == 4:
                            os.kill(workers[1].pid, signal.SIGKILL)
                except httpx.TransportError:
                    lines.append("<connection closed>")
        # The stream did not run to its end: it ended with an error (event or closed socket).
        assert len(lines) < MAX_LEN
        assert any("error" in line or line == "<connection closed>" for line in lines), lines[-3:]
        # New requests are refused (503) until the server is gone, and it goes, on its own.
        try:
            r = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=5)
            assert r.status_code == 503, r.text
        except httpx.TransportError:
            pass  # already gone
        assert server.wait(timeout=30) == 1
        log.seek(0)
        text = log.read()
        assert "the engine stopped" in text and "worker rank 1" in text, text[-2000:]
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=10)
        log.close()



@pytest.mark.timeout(180)
@pytest.mark.tp_full  # run with --tp-full (tests/conftest.py)
def test_torchrun_two_local_nodes_serve_like_one_process(tmp_path, offline):
    """Two torchrun agents on this machine stand for two nodes (one rank each): rank 0 serves,
    rank 1 is its worker; the answer matches one process; stopping node 0 stops node 1."""
    port, master_port = _free_port(), _free_port()
    env = {**os.environ, "KVSERVE_WORKER_AUTHKEY": os.urandom(16).hex()}
    agents, logs = [], []
    for node in (0, 1):
        logs.append(open(tmp_path / f"node{node}.log", "w+"))
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
             "-m", "kvserve.cli", "serve", "--model", MODEL, "--dtype", "float32",
             "--max-model-len", str(MAX_LEN), "--tensor-parallel-size", "2", "--port", str(port),
             "--log-level", "warning"], env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(url, agents, 120, "no server")
        prompt = "The capital of France is"
        want = offline.generate(prompt, __import__("kvserve").SamplingParams(temperature=0.0, max_tokens=12))
        resp = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert resp.json()["choices"][0]["text"] == want[0].outputs[0].text
        agents[0].send_signal(signal.SIGTERM)
        for agent in agents:
            agent.wait(timeout=60)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=10)
        for log in logs:
            log.close()
