"""Peer: OpenVINO GenAI's ``ContinuousBatchingPipeline`` (Intel's CPU serving engine: paged
attention, continuous batching, int4/int8 weights) on the same weights and prompt ids.

``openvino-int4`` runs the model exported with issue 63's ``--weight-format int4 --group-size
64 --ratio 1.0 --sym``, ``openvino-int8`` with ``--weight-format int8`` (openvino_export.py).
The pipeline runs in the OpenVINO venv's python (``openvino_worker.py serve``), a child of
this peer: greedy, the same max tokens, EOS ignored, every request submitted at once, timed
per pipeline step inside the child (its own clock: only differences cross the pipe).
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvserve.bench.openvino_export import (FORMATS, ExportPaths, OpenVinoVenv, child_env,
                                           default_cache_dir, ensure_exported, worker_command)
from kvserve.bench.timing import EngineRun, RequestTiming
from kvserve.bench.workloads import Workload

PEER_FORMATS = {"openvino-int4": "int4", "openvino-int8": "int8"}


class WorkerError(RuntimeError):
    """The OpenVINO worker answered with an error, or stopped answering."""


@dataclass(frozen=True)
class PipelineSettings:
    """What the pipeline is given, as kvserve is: threads, KV cache size, tokens per step."""

    num_threads: int
    cache_gb: int = 1  # kvserve's default KV pool on the CPU: 1 GiB (OpenVINO takes whole GB)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256


def serve_command(venv: OpenVinoVenv, model_dir: Path, settings: PipelineSettings) -> list[str]:
    return worker_command(venv, "serve", "--model", str(model_dir), "--threads", str(settings.num_threads),
                          "--cache-gb", str(settings.cache_gb),
                          "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
                          "--max-num-seqs", str(settings.max_num_seqs))


def run_request(workload: Workload) -> dict:
    return {"cmd": "run", "prompts": workload.prompts, "output_lens": workload.output_lens,
            "max_concurrency": workload.max_concurrency}


def parse_reply(line: str) -> dict:
    """One reply line -> its payload; an error reply or a line that is not one raises."""
    if not line:
        raise WorkerError("the OpenVINO worker exited without answering (its stderr says why)")
    try:
        reply = json.loads(line)
    except json.JSONDecodeError:
        raise WorkerError(f"the OpenVINO worker answered something else: {line[:200]!r}") from None
    if not reply.get("ok"):
        raise WorkerError(f"the OpenVINO worker failed: {reply.get('error', reply)}")
    return reply


def engine_run(name: str, payload: dict, extra: dict) -> EngineRun:
    """A ``run`` reply's traces as the bench's EngineRun (the child's clock throughout)."""
    timings = []
    for r in payload["requests"]:
        t = RequestTiming(prompt_len=r["prompt_len"], start=r["submitted"])
        t.output_token_ids = [int(x) for x in r["token_ids"]]
        t.token_times = [float(x) for x in r["token_times"]]
        timings.append(t)
    return EngineRun(name, timings, payload["started"], payload["finished"],
                     {**extra, "num_steps": payload["steps"]})


class OpenVinoPeer:
    def __init__(self, name: str, source_kind: str, source_path: str, settings: PipelineSettings,
                 venv: Optional[OpenVinoVenv] = None) -> None:
        self.name = name
        self.venv = venv or OpenVinoVenv.default()
        fmt = FORMATS[PEER_FORMATS[name]]
        paths = ExportPaths(source_kind, source_path, default_cache_dir())
        self.model_dir = ensure_exported(self.venv, paths, fmt)
        self._process = subprocess.Popen(serve_command(self.venv, self.model_dir, settings),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr,
                                         text=True, env=child_env())
        try:
            ready = self._read()
        except WorkerError:
            self._process.kill()
            self._process.wait(5)
            raise
        self.extra = {"weight_format": fmt.name,
                      "optimum_args": " ".join(fmt.optimum_args), "model_dir": str(self.model_dir),
                      **ready["info"]}

    def _read(self) -> dict:
        return parse_reply(self._process.stdout.readline())

    def _call(self, request: dict) -> dict:
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerError(f"the OpenVINO worker has exited (code {self._process.poll()})") from None
        return self._read()

    def warmup(self) -> None:
        self._call({"cmd": "warmup"})

    def run(self, workload: Workload, progress: bool = True) -> EngineRun:
        # A lone request (W3), or requests held back, are timed from their own submission.
        own_turn = workload.num_requests == 1 or workload.max_concurrency is not None
        extra = {**self.extra, "ttft_measured_from": "own turn" if own_turn else "submission"}
        return engine_run(self.name, self._call(run_request(workload))["run"], extra)

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._call({"cmd": "close"})
                self._process.wait(10)
            except (WorkerError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait(5)
