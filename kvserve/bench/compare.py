"""What throughput and latency share: the kvserve driver, the machine limit measured in the
same run, and running each requested peer (each in its own process) on the same workloads,
one at a time."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, TypeVar

import torch

from kvserve.bench.kvserve_driver import KvserveDriver
from kvserve.bench.machine import achieved, machine_limit, machine_load
from kvserve.bench.isolated import IsolatedPeer
from kvserve.bench.peers import PeerContext, PeerUnavailable
from kvserve.bench.timing import EngineRun, greedy_agreement
from kvserve.config import EngineArgs

logger = logging.getLogger("kvserve.bench")
M = TypeVar("M")


@dataclass
class CompareOptions:
    peers: list[str] = field(default_factory=list)
    hf_batch_size: Optional[int] = None  # None: one static batch of the whole workload
    matmul_size: int = 1024
    matmul_seconds: float = 1.0
    repeats: int = 1  # round-robin passes over all engines; each keeps its best
    # The memory's read bandwidth beside the matmul limit (~2 s): for batch-1 decode figures.
    read_bandwidth: bool = False
    progress: bool = True


class BenchSession:
    """kvserve loaded once, the machine's matmul limit, and the context peers are built in."""

    def __init__(self, eargs: EngineArgs, opts: CompareOptions) -> None:
        self.opts = opts
        self.driver = KvserveDriver(eargs)
        engine = self.driver.engine
        self.dtype = engine.dtype
        self.machine = machine_limit(opts.matmul_size, opts.matmul_seconds, str(engine.device),
                                     opts.read_bandwidth)
        self.peer_ctx = PeerContext(source_kind=engine.source.kind, source_path=str(engine.source.path),
                                    num_threads=torch.get_num_threads(), eargs=eargs,
                                    hf_batch_size=opts.hf_batch_size)

    def header(self, command: str) -> dict:
        engine = self.driver.engine
        return {"command": command, "model": self.driver.eargs.model,
                "model_source": {"kind": engine.source.kind, "path": str(engine.source.path)},
                "dtype": str(self.dtype).removeprefix("torch."),
                "weights": engine.weight_format or str(self.dtype).removeprefix("torch."),
                # int4: which prompt rows ran on bf16 copies (--int4-prefill) and what they cost.
                **({"int4_prefill": self.driver.eargs.int4_prefill,
                    "prefill_copy_mib": round(engine.prefill_copy_bytes / 2**20, 1)}
                   if engine.weight_format == "int4" else {}),
                "device": str(engine.device),
                # Multi-step decoding (--num-scheduler-steps), as the engine runs it (1: off).
                "num_scheduler_steps": engine.scheduler.num_scheduler_steps,
                "num_threads": torch.get_num_threads(), "machine": self.machine,
                "load_average": machine_load()}

    def kvserve_summary(self, run: EngineRun) -> dict:
        s = summarize(run)
        s["dtype"] = str(self.dtype).removeprefix("torch.")
        s.update(achieved(run.extra["model_gflop"] * 1e9, run.elapsed_s, self.machine, self.dtype))
        return s

    def round_robin(self, measure: Callable[[object], M], score: Callable[[M], float]
                    ) -> tuple[dict[str, M], dict[str, list[float]], dict[str, str]]:
        """Run ``measure(engine)`` for kvserve and each requested peer, ``repeats`` times in
        turn (kvserve, peer 1, ..., kvserve, peer 1, ...) so that load from other work on
        the machine falls on every engine alike, and keep each engine's best-scoring
        measurement. Returns (best by engine name, every score by name, skipped peers)."""
        self.driver.warmup()
        engines: list = [self.driver]
        skipped: dict[str, str] = {}
        for name in self.opts.peers:
            try:
                peer = IsolatedPeer(name, self.peer_ctx)  # a crash takes only itself down
                engines.append(peer)
                peer.warmup()
            except PeerUnavailable as exc:
                skipped[name] = str(exc)
                print(f"kvserve bench: skipping {name}: {exc}", file=sys.stderr)
            except Exception as exc:  # a broken peer must not lose kvserve's figures
                logger.exception("peer %s failed", name)
                skipped[name] = f"failed: {exc!r}"
        engines = [e for e in engines if e.name not in skipped]
        best: dict[str, M] = {}
        scores: dict[str, list[float]] = {}
        try:
            for _ in range(max(1, self.opts.repeats)):
                for engine in list(engines):
                    try:
                        m = measure(engine)
                    except Exception as exc:
                        if engine is self.driver:
                            raise
                        logger.exception("peer %s failed", engine.name)
                        skipped[engine.name] = f"failed: {exc!r}"
                        engines.remove(engine)
                        best.pop(engine.name, None)
                        continue
                    scores.setdefault(engine.name, []).append(score(m))
                    if engine.name not in best or score(m) > score(best[engine.name]):
                        best[engine.name] = m
        finally:
            for engine in engines[1:]:
                engine.close()
            self.peer_ctx.close()
        return best, scores, skipped


def summarize(run: EngineRun, reference: Optional[EngineRun] = None) -> dict:
    s = run.summary()
    s["per_request"] = [{"prompt_len": r.prompt_len, "output_len": r.num_output_tokens,
                         "ttft_ms": r.ttft * 1e3 if r.ttft is not None else None,
                         "tpot_ms": r.tpot * 1e3 if r.tpot is not None else None}
                        for r in run.requests]
    if reference is not None:
        s["greedy_agreement_with_kvserve"] = greedy_agreement(reference, run)
    return s
