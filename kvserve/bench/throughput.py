"""``kvserve bench throughput``: an offline workload, all requests submitted at once."""
from __future__ import annotations

from typing import Callable, Optional

from kvserve.bench.compare import BenchSession, CompareOptions, summarize
from kvserve.bench.report import result_ratios
from kvserve.bench.timing import EngineRun
from kvserve.bench.workloads import Workload
from kvserve.config import EngineArgs

# Given the loaded kvserve driver (for its vocabulary and tokenizer), build the workload.
WorkloadFactory = Callable[[object], Workload]


def run_throughput(eargs: EngineArgs, make_workload: WorkloadFactory,
                   opts: Optional[CompareOptions] = None) -> tuple[dict, dict[str, EngineRun]]:
    """The result (JSON-ready) and each engine's raw run (for plots)."""
    opts = opts or CompareOptions()
    session = BenchSession(eargs, opts)
    workload = make_workload(session.driver)
    runs, scores, skipped = session.round_robin(
        lambda engine: engine.run(workload, progress=opts.progress),
        lambda run: run.summary()["output_tokens_per_s"])
    ours = runs["kvserve"]
    kvserve = session.kvserve_summary(ours)
    peers = {name: summarize(run, reference=ours) for name, run in runs.items() if name != "kvserve"}
    for name, s in [("kvserve", kvserve), *peers.items()]:
        s["output_tokens_per_s_each_repeat"] = scores[name]
    result = {**session.header("throughput"), "repeats": opts.repeats, "workload": workload.describe(),
              "kvserve": kvserve, "peers": peers, "skipped_peers": skipped}
    result["ratios"] = result_ratios(result)
    return result, runs
