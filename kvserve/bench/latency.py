"""``kvserve bench latency``: one request at a time (TTFT, TPOT at batch 1), and a prefill
sweep over prompt lengths showing how prefill cost grows with length."""
from __future__ import annotations

import dataclasses
from typing import Optional

from kvserve.bench.compare import BenchSession, CompareOptions, summarize
from kvserve.bench.decode_bytes import summary_bandwidth_use
from kvserve.bench.machine import achieved
from kvserve.bench.report import compute_ratios, result_ratios
from kvserve.bench.timing import EngineRun
from kvserve.bench.workloads import Workload, WorkloadSpec, build_workload
from kvserve.config import EngineArgs

DEFAULT_PREFILL_LENS = (128, 256, 512, 1024, 2048)


def _single_streams(spec: WorkloadSpec, num_iters: int, vocab: int) -> list[Workload]:
    # A fresh prompt each iteration, so no iteration is served by the prefix cache.
    spec = spec.with_overrides(num_requests=1)
    return [build_workload(spec.with_overrides(seed=spec.seed + i), vocab) for i in range(num_iters)]


def _sweep(lengths: list[int], vocab: int, seed: int) -> list[Workload]:
    return [build_workload(WorkloadSpec(f"prefill-{n}", "prefill", 1, (n, n), 1,
                                        seed=seed + 7919 * (i + 1)), vocab)
            for i, n in enumerate(lengths)]


def _measure(engine, streams: list[Workload], sweep: list[Workload], progress: bool
             ) -> tuple[EngineRun, dict[int, EngineRun]]:
    runs = [engine.run(w, progress=progress) for w in streams]
    combined = EngineRun(engine.name, [r for run in runs for r in run.requests],
                         runs[0].started, runs[-1].finished, dict(runs[0].extra))
    if "model_gflop" in combined.extra:
        combined.extra["model_gflop"] = sum(r.extra["model_gflop"] for r in runs)
        combined.extra["busy_s"] = sum(r.elapsed_s for r in runs)
    prefill = {len(w.prompts[0]): engine.run(w, progress=False) for w in sweep}
    return combined, prefill


def _sweep_row(run: EngineRun) -> dict:
    ttft = run.requests[0].ttft
    return {"ttft_ms": ttft * 1e3, "prefill_tokens_per_s": run.requests[0].prompt_len / ttft}


def run_latency(eargs: EngineArgs, spec: WorkloadSpec, num_iters: int = 1,
                prefill_lens: Optional[list[int]] = None,
                opts: Optional[CompareOptions] = None) -> tuple[dict, dict[str, EngineRun]]:
    # Batch-1 decode is bound by its reads: measure the memory's limit in the same run.
    opts = dataclasses.replace(opts or CompareOptions(), read_bandwidth=True)
    session = BenchSession(eargs, opts)
    driver = session.driver
    vocab = driver.vocab_size
    max_len = driver.engine.max_model_len
    lengths = [n for n in (prefill_lens if prefill_lens is not None else DEFAULT_PREFILL_LENS)
               if n + 1 <= max_len]
    skipped_lengths = [n for n in (prefill_lens or DEFAULT_PREFILL_LENS) if n not in lengths]
    streams = _single_streams(spec, num_iters, vocab)
    sweep = _sweep(lengths, vocab, spec.seed)

    def score(m: tuple[EngineRun, dict[int, EngineRun]]) -> float:
        return m[0].summary()["output_tokens_per_s"]

    measured, scores, skipped = session.round_robin(
        lambda engine: _measure(engine, streams, sweep, opts.progress), score)
    ours, our_sweep = measured["kvserve"]
    runs = {name: m[0] for name, m in measured.items()}
    kvserve = summarize(ours)
    kvserve["ttft_measured_from"] = "own turn"  # one request at a time: nothing queues
    kvserve["dtype"] = str(session.dtype).removeprefix("torch.")
    kvserve.update(achieved(ours.extra["model_gflop"] * 1e9, ours.extra["busy_s"],
                            session.machine, session.dtype))
    rows = {n: {"prompt_len": n, "kvserve": _sweep_row(run)} for n, run in our_sweep.items()}
    for n, run in our_sweep.items():
        rows[n]["kvserve"].update(achieved(run.extra["model_gflop"] * 1e9, run.requests[0].ttft,
                                           session.machine, session.dtype))
    peers = {}
    for name, (run, peer_sweep) in measured.items():
        if name == "kvserve":
            continue
        peers[name] = summarize(run, reference=ours)
        for n, prun in peer_sweep.items():
            rows[n][name] = _sweep_row(prun)
    read_gbs = (session.machine.get("read_bandwidth") or {}).get("gbs")
    for name, s in [("kvserve", kvserve), *peers.items()]:
        s["output_tokens_per_s_each_repeat"] = scores[name]
        # kvserve's engines only (the peers' bytes are not counted): bytes per token / TPOT.
        use = summary_bandwidth_use(s, read_gbs)
        if use is not None:
            s["decode_bandwidth"] = use

    workload = streams[0].describe()
    workload.update(num_iters=num_iters, num_requests=1)
    result = {**session.header("latency"), "repeats": opts.repeats, "workload": workload,
              "kvserve": kvserve, "peers": peers, "skipped_peers": skipped,
              "prefill_sweep": [rows[n] for n in lengths],
              "prefill_lengths_skipped": skipped_lengths}
    result["ratios"] = result_ratios(result)
    for row in result["prefill_sweep"]:
        peer_rows = {p: row[p] for p in peers if p in row}
        row["ratios"] = compute_ratios(
            row["kvserve"], peer_rows,
            [("prefill_tokens_per_s", lambda s: s.get("prefill_tokens_per_s"), True)])
    return result, runs
