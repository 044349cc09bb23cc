"""Async scheduling against the synchronous step (issue bar: at batch 16 with structured outputs,
TPOT <= 0.85x the synchronous engine's, the model in a worker process in both, outputs
identical).

Both engines run the model in one worker process (``worker_process=True``); they are built
once and run alternately, ``--rounds`` times each, in this process. A round: 16 greedy
requests constrained by a JSON schema (benchmarks/structured_tpot.py's, a list of records
that keeps going), timed from the step where every request has its first token over the next
``--tokens`` tokens of each. Reported per mode (medians over rounds):

- TPOT: window wall time / tokens each request got in it;
- host share: the part of that time the engine's thread was not blocked waiting for the
  worker (MultiprocExecutor.wait_time_s), and the host time per token step.

The same requests' token ids are compared between the modes (greedy: identical or it fails).
The machine is shared: compare the modes within one run, not across runs.

    python benchmarks/async_scheduling.py [--model smollm2-135m-instruct] [--batch 16] [--tokens 48]
        [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass

from kvserve import SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.structured import StructuredOutputsParams

from structured_tpot import PROMPT, SCHEMA


@dataclass
class Round:
    tpot_s: float
    host_share: float
    host_s_per_token_step: float
    token_ids: list[list[int]]


def run_round(engine: LLMEngine, batch: int, tokens: int) -> Round:
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 16,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    ids = [engine.add_request(None, PROMPT + " " * i, params) for i in range(batch)]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    start = None  # (wall, executor wait, tokens per request) when every request has its first token
    t_end = wait_end = 0.0
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
        counts = [len(t) for t in got.values()]
        if start is None and min(counts) >= 1:
            start = (time.perf_counter(), engine.executor.wait_time_s, min(counts))
        elif start is not None and min(counts) - start[2] >= tokens:
            t_end, wait_end, produced = time.perf_counter(), engine.executor.wait_time_s, min(counts) - start[2]
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
            break
    if start is None or not produced:
        raise RuntimeError("a request finished before the window: raise --tokens' headroom or change the schema")
    wall, waited = t_end - start[0], wait_end - start[1]
    return Round(tpot_s=wall / produced, host_share=1.0 - waited / wall,
                 host_s_per_token_step=(wall - waited) / produced,
                 token_ids=[got[rid][:start[2] + tokens] for rid in ids])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="the worker's (and the engine's) torch threads")
    ns = parser.parse_args()
    engines = {mode: LLMEngine(EngineArgs(model=ns.model, worker_process=True, async_scheduling=mode == "async",
                                          num_threads=ns.threads, max_num_seqs=ns.batch,
                                          kv_cache_memory=256 << 20))
               for mode in ("sync", "async")}
    try:
        for engine in engines.values():  # warm-up: grammar compiler, first steps
            run_round(engine, ns.batch, 8)
        rounds: dict[str, list[Round]] = {mode: [] for mode in engines}
        for _ in range(ns.rounds):
            for mode, engine in engines.items():
                rounds[mode].append(run_round(engine, ns.batch, ns.tokens))
    finally:
        for engine in engines.values():
            engine.shutdown()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"{ns.model}, batch {ns.batch} with a JSON schema, greedy, worker process ({ns.threads} thread(s)) "
          f"in both; {ns.tokens} tokens per request per round, {ns.rounds} rounds; CPU: {cpu}")
    med = {}
    for mode, rs in rounds.items():
        med[mode] = (statistics.median(r.tpot_s for r in rs), statistics.median(r.host_share for r in rs),
                     statistics.median(r.host_s_per_token_step for r in rs))
        print(f"  {mode:5s}  TPOT {med[mode][0] * 1e3:7.2f} ms   host share {med[mode][1] * 100:5.1f} %   "
              f"host {med[mode][2] * 1e3:6.2f} ms per token step   (rounds: "
              + ", ".join(f"{r.tpot_s * 1e3:.1f}" for r in rs) + " ms)")
    identical = all(a.token_ids == b.token_ids for a, b in zip(rounds["sync"], rounds["async"]))
    ratio = med["async"][0] / med["sync"][0]
    print(f"  async / sync TPOT: {ratio:.3f} (bar <= 0.85); outputs identical: {identical}")
    if not identical:
        raise SystemExit("async outputs differ from the synchronous engine's")


if __name__ == "__main__":
    main()
