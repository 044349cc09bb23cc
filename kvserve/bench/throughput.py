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
    session.driver.warmup()
    ours = session.driver.run(workload, progress=opts.progress)
    runs = {"kvserve": ours}

    def body(peer) -> dict:
        run = peer.run(workload, progress=opts.progress)
        runs[peer.name] = run
        return summarize(run, reference=ours)

    kvserve = session.kvserve_summary(ours)
    peers, skipped = session.run_peers(body)
    result = {**session.header("throughput"), "workload": workload.describe(),
              "kvserve": kvserve, "peers": peers, "skipped_peers": skipped}
    result["ratios"] = result_ratios(result)
    return result, runs
