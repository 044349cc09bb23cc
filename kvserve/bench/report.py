"""Ratios against peers, the printed summaries, and the README results table.

Ratios are always kvserve / peer: above 1 is better for a throughput, below 1 is better for
a latency. "Best" is the best peer on that metric (highest throughput, lowest latency).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Callable, Optional

Getter = Callable[[dict], Optional[float]]


def _dist(key: str, stat: str = "mean") -> Getter:
    return lambda s: (s.get(key) or {}).get(stat)


# (label, getter, higher is better)
THROUGHPUT_METRICS: list[tuple[str, Getter, bool]] = [
    ("output_tokens_per_s", lambda s: s.get("output_tokens_per_s"), True),
    ("ttft_mean_ms", _dist("ttft_ms"), False),
    ("tpot_mean_ms", _dist("tpot_ms"), False),
]
LATENCY_METRICS: list[tuple[str, Getter, bool]] = [
    ("ttft_mean_ms", _dist("ttft_ms"), False),
    ("tpot_mean_ms", _dist("tpot_ms"), False),
    ("output_tokens_per_s", lambda s: s.get("output_tokens_per_s"), True),
]


def compute_ratios(ours: dict, peers: dict[str, dict],
                   metrics: list[tuple[str, Getter, bool]]) -> dict:
    """{"vs": {peer: {metric: ours/peer}}, "vs_best": {metric: {"peer", "ratio", "value"}}}

    A latency is only comparable between engines that start the clock at the same moment:
    kvserve's offline requests are timed from submission, a sequential peer's from its own
    turn. So "best" on a latency metric is picked among peers timed like kvserve; the
    per-peer ratios are all kept."""
    ours_from = ours.get("ttft_measured_from", "submission")
    vs: dict[str, dict] = {}
    best: dict[str, dict] = {}
    for label, get, higher in metrics:
        mine = get(ours)
        candidates = [(name, get(s)) for name, s in peers.items() if get(s)]
        for name, value in candidates:
            vs.setdefault(name, {})[label] = mine / value if mine is not None else None
        if not higher:
            candidates = [(name, v) for name, v in candidates
                          if peers[name].get("ttft_measured_from", "submission") == ours_from]
        if candidates:
            name, value = (max if higher else min)(candidates, key=lambda nv: nv[1])
            best[label] = {"peer": name, "value": value,
                           "ratio": mine / value if mine is not None else None}
    return {"vs": vs, "vs_best": best}


def result_ratios(result: dict) -> dict:
    """The ratios of a throughput or latency result, from its summaries."""
    metrics = LATENCY_METRICS if result["command"] == "latency" else THROUGHPUT_METRICS
    return compute_ratios(result["kvserve"], result.get("peers", {}), metrics)


# ---------------------------------------------------------------------------------- printing
def _f(value: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _triple(dist: Optional[dict]) -> str:
    dist = dist or {}
    return "/".join(_f(dist.get(k), "{:.1f}") for k in ("mean", "p50", "p99"))


def engine_table(rows: dict[str, dict]) -> str:
    head = (f"{'engine':<18} {'req/s':>7} {'out tok/s':>10} {'total tok/s':>11}  "
            f"{'TTFT mean/p50/p99 ms':>22}  {'TPOT mean/p50/p99 ms':>22}")
    lines = [head, "-" * len(head)]
    for name, s in rows.items():
        lines.append(f"{name:<18} {_f(s.get('requests_per_s'), '{:.2f}'):>7} "
                     f"{_f(s.get('output_tokens_per_s')):>10} {_f(s.get('total_tokens_per_s')):>11}  "
                     f"{_triple(s.get('ttft_ms')):>22}  {_triple(s.get('tpot_ms')):>22}")
    return "\n".join(lines)


def ratio_lines(ratios: dict) -> str:
    if not ratios.get("vs"):
        return ""
    labels = list(ratios["vs_best"]) or list(next(iter(ratios["vs"].values())))
    head = f"{'kvserve / peer':<18} " + " ".join(f"{label:>28}" for label in labels)
    lines = [head]
    for name, by_metric in ratios["vs"].items():
        lines.append(f"{name:<18} " + " ".join(f"{_f(by_metric.get(m), '{:.2f}x'):>28}"
                                               for m in labels))
    lines.append(f"{'best peer':<18} " + " ".join(
        f"{_f(ratios['vs_best'][m]['ratio'], '{:.2f}x') + ' (' + ratios['vs_best'][m]['peer'] + ')':>28}"
        if m in ratios["vs_best"] else f"{'-':>28}" for m in labels))
    lines.append("(throughput: above 1x is kvserve ahead; latency: below 1x is kvserve ahead)")
    return "\n".join(lines)


def machine_line(machine: Optional[dict]) -> str:
    if not machine:
        return ""
    g = machine["gflops"]
    line = (f"machine limit (torch.matmul {machine['matmul_size']}^3, {machine['num_threads']} "
            f"threads): bf16 {g['bfloat16']:.1f} GFLOP/s, fp32 {g['float32']:.1f} GFLOP/s")
    bandwidth = machine.get("read_bandwidth")
    if bandwidth:
        line += (f"; read bandwidth {bandwidth['gbs']:.1f} GB/s (best of {bandwidth['repeats']} sums "
                 f"over {bandwidth['buffer_bytes'] // 2**20} MiB)")
    cpu = machine.get("cpu")
    if cpu:
        routes = machine.get("kernel_routes") or {}
        route = f"; bf16 kernel route {routes['bf16']}" if "bf16" in routes else ""
        route += f", attention route {routes['attention']}" if "attention" in routes else ""
        line = f"cpu: {cpu['model']} [{' '.join(cpu['features']) or 'no AVX2'}]{route}\n" + line
    return line


def bandwidth_line(name: str, use: dict) -> str:
    """A single-stream run's decode reads against the machine's (``decode_bandwidth``)."""
    return (f"{name}: a decode token reads {use['bytes_per_token'] / 1e6:.1f} MB (weights "
            f"{use['weight_bytes'] / 1e6:.1f} + KV {use['kv_bytes'] / 1e6:.2f}) in {use['tpot_ms']:.2f} ms = "
            f"{use['achieved_read_gbs']:.1f} GB/s, {use['fraction_of_read_bandwidth']:.2f} of the measured "
            f"{use['read_bandwidth_gbs']:.1f} GB/s read bandwidth")


def kvserve_line(s: dict) -> str:
    parts = []
    if "peak_kv_blocks_used" in s:
        parts.append(f"peak KV blocks {s['peak_kv_blocks_used']}/{s['kv_blocks_total']}")
        parts.append(f"prefix-cache hit rate {100 * s['prefix_cache_hit_rate']:.1f} %")
        parts.append(f"preemptions {s['num_preemptions']}")
    if s.get("achieved_gflops") is not None:
        own = s.get("fraction_of_matmul_limit_same_dtype")
        best = s.get("fraction_of_best_matmul_limit")
        parts.append(f"achieved {s['achieved_gflops']:.1f} GFLOP/s = {_f(own and 100 * own)} % of "
                     f"the {s.get('dtype', '?')} matmul limit ({_f(best and 100 * best)} % of the best)")
    return "kvserve: " + ", ".join(parts) if parts else ""


def print_summary(result: dict, file=None) -> None:
    file = file or sys.stdout
    w = result.get("workload", {})
    print(f"\n== {result['command']}: {w.get('name', '')} — {w.get('description', '')}", file=file)
    iters = f" x {w['num_iters']} iterations" if w.get("num_iters", 1) > 1 else ""
    print(f"   model {result.get('model')} ({result.get('dtype')}, {result.get('num_threads')} threads): "
          f"{w.get('total_prompt_tokens')} prompt + {w.get('total_output_tokens')} output tokens"
          f"{iters}", file=file)
    load = result.get("load_average")
    if load and load["load_1min"] > 0.5 * (load["cpu_count"] or 1):
        print(f"   note: machine busy at the start (load {load['load_1min']:.1f} on "
              f"{load['cpu_count']} cores): other work skews these figures", file=file)
    for line in (machine_line(result.get("machine")),
                 engine_table({"kvserve": result["kvserve"], **result.get("peers", {})}),
                 kvserve_line(result["kvserve"]),
                 ratio_lines(result.get("ratios", {}))):
        if line:
            print(line, file=file)
    for name, s in result.get("peers", {}).items():
        if s.get("greedy_agreement_with_kvserve") is not None:
            print(f"  {name}: greedy tokens agree with kvserve on "
                  f"{100 * s['greedy_agreement_with_kvserve']:.0f} % of outputs (prefix match)",
                  file=file)
    for name, s in {"kvserve": result["kvserve"], **result.get("peers", {})}.items():
        if s.get("decode_bandwidth"):
            print("  " + bandwidth_line(name, s["decode_bandwidth"]), file=file)
    for name, s in {"kvserve": result["kvserve"], **result.get("peers", {})}.items():
        if s.get("spec_draft_tokens") is not None:
            print(f"  {name}: speculative decoding {s['spec_draft_tokens']} drafted, "
                  f"{s['spec_accepted_tokens']} accepted ({100 * s['spec_acceptance_rate']:.1f} %), "
                  f"mean accepted length {s['spec_mean_accepted_length']:.2f}", file=file)
    for name, reason in result.get("skipped_peers", {}).items():
        print(f"  skipped {name}: {reason}", file=file)
    sweep = result.get("prefill_sweep")
    if sweep:
        print("prefill (batch 1, one output token): tokens/s by prompt length", file=file)
        engines = ["kvserve"] + [p for p in result.get("peers", {})]
        print(f"  {'prompt len':>10} " + " ".join(f"{e:>16}" for e in engines), file=file)
        for row in sweep:
            print(f"  {row['prompt_len']:>10} " + " ".join(
                f"{_f(row.get(e, {}).get('prefill_tokens_per_s')):>16}" for e in engines), file=file)


def write_json(result: dict, path: Optional[str]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


# ------------------------------------------------------------------------- README table
def _markers(key: str) -> tuple[str, str]:
    suffix = f" {key}" if key else ""
    return f"<!-- results:begin{suffix} -->", f"<!-- results:end{suffix} -->"


def _cell(s: Optional[dict]) -> str:
    if not s:
        return "—"
    return (f"{s['output_tokens_per_s']:.1f} tok/s · TTFT {_f(_dist('ttft_ms')(s), '{:.0f}')} ms · "
            f"TPOT {_f(_dist('tpot_ms')(s))} ms")


def _vs_best(r: dict, metric: str) -> str:
    best = result_ratios(r)["vs_best"].get(metric)
    return f"{best['ratio']:.2f}x ({best['peer']})" if best and best.get("ratio") else "—"


def markdown_table(results: list[dict]) -> str:
    """One row per bench result: kvserve and each peer (output tok/s, mean TTFT and TPOT),
    kvserve / best peer on each, and kvserve's share of the machine's matmul limit."""
    peers: list[str] = []
    for r in results:
        for name in r.get("peers", {}):
            if name not in peers:
                peers.append(name)
    head = (["workload", "kvserve"] + peers
            + ["out tok/s vs best", "TTFT vs best", "TPOT vs best", "kvserve % of matmul limit"])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        w = r["workload"]
        frac = r["kvserve"].get("fraction_of_best_matmul_limit")
        # kvserve's default on a CPU with fast bf16 is bf16 weights; other formats are named.
        weights = r.get("weights")
        label = f"{w['name']} ({r['command']}" + (f", {weights} weights)" if weights not in (None, "bf16") else ")")
        row = [label, _cell(r["kvserve"])]
        row += [_cell(r.get("peers", {}).get(p)) for p in peers]
        row += [_vs_best(r, "output_tokens_per_s"), _vs_best(r, "ttft_mean_ms"),
                _vs_best(r, "tpot_mean_ms"), f"{100 * frac:.1f} %" if frac else "—"]
        lines.append("| " + " | ".join(row) + " |")
    for r in results:
        sweep = r.get("prefill_sweep")
        if sweep:
            engines = ["kvserve"] + list(r.get("peers", {}))
            weights = r.get("weights")
            run = r["workload"]["name"] + (f", {weights} weights" if weights not in (None, "bf16") else "")
            lines += ["", f"Prefill tokens/s at batch 1 ({run} run):", "",
                      "| prompt len | " + " | ".join(engines) + " |", "|" + " --- |" * (len(engines) + 1)]
            for row in sweep:
                lines.append(f"| {row['prompt_len']} | " + " | ".join(
                    _f(row.get(e, {}).get("prefill_tokens_per_s")) for e in engines) + " |")
    machine = next((r["machine"] for r in results if r.get("machine")), None)
    if machine:
        lines += ["", machine_line(machine) + "."]
    loads = [f"{r['workload']['name']} {r['load_average']['load_1min']:.1f}" for r in results
             if r.get("load_average")]
    if loads:
        lines += ["", "1-minute load average when each run started (other work on the machine): "
                  + ", ".join(loads) + "."]
    return "\n".join(lines)


def profile_table(result: dict) -> str:
    wall = result["wall_s"]
    lines = [f"Profile of {result['workload']['name']} ({result['model']}, {result['dtype']}, "
             f"{result['num_threads']} threads), wall {wall:.2f} s under the profiler:", "",
             "| category | time s | % of wall |", "| --- | --- | --- |"]
    for name, sec in result["categories_s"].items():
        label = name.strip() if not name.startswith("  ") else "&nbsp;&nbsp;" + name.strip()
        lines.append(f"| {label} | {sec:.3f} | {100 * sec / wall:.1f} % |")
    lines += ["", "Top aten ops by self CPU time: " + ", ".join(
        f"{row['op']} {row['self_cpu_s']:.2f} s" for row in result["top_ops"][:6]) + "."]
    return "\n".join(lines)


def update_readme(readme: str, table: str, key: str = "") -> None:
    begin, end = _markers(key)
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{readme}: no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(readme, "w", encoding="utf-8") as f:
        f.write(f"{head}{begin}\n{table}\n{end}{tail}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Build the results table from bench JSON files")
    parser.add_argument("results", nargs="+", help="JSON files (or directories of them)")
    parser.add_argument("--update-readme", default=None, help="README with results markers")
    parser.add_argument("--key", default="", help="marker key: <!-- results:begin KEY -->")
    ns = parser.parse_args(argv)
    paths = []
    for p in ns.results:
        paths += sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p]
    paths = [p for p in paths if not p.endswith(".trace.json")]  # Chrome traces: large, not results
    benches, profiles = [], []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            try:
                r = json.load(f)
            except json.JSONDecodeError:
                continue
        if not isinstance(r, dict):
            continue
        if r.get("command") in ("throughput", "latency"):
            benches.append(r)
        elif r.get("command") == "profile":
            profiles.append(r)
    # By workload; within one, the default weight format's row first.
    benches.sort(key=lambda r: (r["workload"]["name"], r.get("weights") not in (None, "bf16")))
    parts = [markdown_table(benches)] if benches else []
    parts += [profile_table(r) for r in profiles]
    table = "\n\n".join(parts)
    if ns.update_readme:
        update_readme(ns.update_readme, table, ns.key)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
