"""Argument parsing for ``kvserve bench throughput | latency | serve`` and ``kvserve profile``."""
from __future__ import annotations

import argparse
import math
import os
from typing import Callable

AddEngineArgs = Callable[[argparse.ArgumentParser], None]
EngineArgsFrom = Callable[..., object]


def _prompt_len(text: str) -> tuple[int, int]:
    """``256`` or ``32-512``."""
    try:
        lo, _, hi = text.partition("-")
        return (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"prompt length must be N or A-B, got {text!r}") from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_workload_args(p: argparse.ArgumentParser, default: str, with_input: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default=default, help="W1 | W2 | W3 | W4 | W5 | W6 (see benchmarks/README.md)")
    if with_input:
        g.add_argument("--input", default=None,
                       help="JSONL of requests: {prompt_len | prompt_token_ids | prompt, output_len}")
    g.add_argument("--num-requests", type=int, default=None, help="override the workload's")
    g.add_argument("--prompt-len", type=_prompt_len, default=None, help="override: N or A-B")
    g.add_argument("--output-len", type=int, default=None, help="override the workload's")
    g.add_argument("--shared-prefix-len", type=int, default=None, help="override the workload's")
    g.add_argument("--workload-seed", type=int, default=None, help="seed of the prompt tokens")


def _add_compare_args(p: argparse.ArgumentParser) -> None:
    from kvserve.bench.peers import ALIASES, PEER_NAMES

    g = p.add_argument_group("comparison")
    g.add_argument("--compare", default="",
                   help="peers run on the same workload in this run, comma-separated: "
                        f"{', '.join(list(ALIASES) + PEER_NAMES)}")
    g.add_argument("--hf-batch-size", type=int, default=None,
                   help="static batch size of the hf-*-batch peers (default: whole workload)")
    g.add_argument("--repeats", type=int, default=1,
                   help="run kvserve and the peers in turn this many times, keeping each one's "
                        "best run (evens out load from other work on the machine)")
    g.add_argument("--matmul-size", type=int, default=1024, help="matrix size of the machine-limit matmul")
    g.add_argument("--matmul-seconds", type=float, default=1.0, help="time per dtype of that matmul")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the results (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _spec_from(ns: argparse.Namespace):
    from kvserve.bench.workloads import get_spec

    return get_spec(ns.workload).with_overrides(
        num_requests=ns.num_requests, prompt_len=ns.prompt_len, output_len=ns.output_len,
        shared_prefix_len=ns.shared_prefix_len, seed=ns.workload_seed)


def _compare_opts(ns: argparse.Namespace, sequential_only: bool):
    from kvserve.bench.compare import CompareOptions
    from kvserve.bench.peers import expand_peer_names

    return CompareOptions(peers=expand_peer_names(ns.compare, sequential_only),
                          hf_batch_size=ns.hf_batch_size, repeats=ns.repeats,
                          matmul_size=ns.matmul_size,
                          matmul_seconds=ns.matmul_seconds, progress=not ns.no_progress)


def _distributions(runs: dict) -> dict:
    return {"TTFT (ms)": {n: [r.ttft * 1e3 for r in run.requests if r.ttft is not None]
                          for n, run in runs.items()},
            "TPOT (ms)": {n: [r.tpot * 1e3 for r in run.requests if r.tpot is not None]
                          for n, run in runs.items()}}


def _emit(result: dict, ns: argparse.Namespace) -> None:
    from kvserve.bench.report import print_summary, write_json

    print_summary(result)
    write_json(result, ns.json)
    if ns.json:
        print(f"results: {ns.json}")


# ------------------------------------------------------------------------------ commands
def make_commands(engine_args_from: EngineArgsFrom):
    def cmd_throughput(ns: argparse.Namespace) -> int:
        from kvserve.bench.plot import plot_bench
        from kvserve.bench.throughput import run_throughput
        from kvserve.bench.workloads import build_workload, load_jsonl_workload

        if ns.input:
            def make(driver):
                return load_jsonl_workload(ns.input, driver.vocab_size, ns.workload_seed or 0,
                                           tokenize=driver.engine.tokenizer.encode,
                                           default_output_len=ns.output_len or 128)
        else:
            spec = _spec_from(ns)

            def make(driver):
                return build_workload(spec, driver.vocab_size, driver.engine.tokenizer.encode)

        result, runs = run_throughput(engine_args_from(ns), make, _compare_opts(ns, False))
        _emit(result, ns)
        if ns.plot:
            bars = {"kvserve": result["kvserve"]["output_tokens_per_s"],
                    **{n: s["output_tokens_per_s"] for n, s in result["peers"].items()}}
            plot_bench(ns.plot, f"throughput {result['workload']['name']}", bars,
                       "output tokens/s", _distributions(runs))
        return 0

    def cmd_latency(ns: argparse.Namespace) -> int:
        from kvserve.bench.latency import run_latency
        from kvserve.bench.plot import plot_bench

        spec = _spec_from(ns)
        result, runs = run_latency(engine_args_from(ns), spec, ns.num_iters, ns.prefill_lens,
                                   _compare_opts(ns, True))
        _emit(result, ns)
        if ns.plot:
            itl = {"ITL (ms)": {n: [x * 1e3 for r in run.requests for x in r.itls]
                                for n, run in runs.items()}}
            series = {}
            for row in result["prefill_sweep"]:
                for name, cell in row.items():
                    if isinstance(cell, dict) and "prefill_tokens_per_s" in cell:
                        series.setdefault(name, {})[row["prompt_len"]] = cell["prefill_tokens_per_s"]
            plot_bench(ns.plot, f"latency {result['workload']['name']}", {}, "",
                       {**_distributions(runs), **itl}, ("prefill tokens/s", series))
        return 0

    def cmd_profile(ns: argparse.Namespace) -> int:
        from kvserve.bench.kvserve_driver import KvserveDriver
        from kvserve.bench.profile import print_profile, run_profile
        from kvserve.bench.report import write_json
        from kvserve.bench.workloads import build_workload

        driver = KvserveDriver(engine_args_from(ns))
        workload = build_workload(_spec_from(ns), driver.vocab_size, driver.engine.tokenizer.encode)
        result = run_profile(driver, workload, ns.trace, progress=not ns.no_progress)
        print_profile(result)
        write_json(result, ns.json)
        return 0

    return cmd_throughput, cmd_latency, cmd_profile


def cmd_serve_bench(ns: argparse.Namespace) -> int:
    from kvserve.bench.plot import plot_bench
    from kvserve.bench.report import write_json
    from kvserve.bench.serve import ServeOptions, print_serve_summary, run_serve
    from kvserve.bench.workloads import build_workload, load_jsonl_workload

    if ns.input:
        # No tokenizer here: rows give prompt_len or prompt_token_ids.
        workload = load_jsonl_workload(ns.input, ns.vocab_size, ns.workload_seed or 0,
                                       default_output_len=ns.output_len or 128)
    else:
        spec = _spec_from(ns)
        workload = build_workload(spec, ns.vocab_size)
    opts = ServeOptions(url=ns.url, model=ns.served_model, request_rate=ns.request_rate,
                        max_concurrency=ns.max_concurrency, endpoint=ns.endpoint,
                        prompt_kind=ns.prompt_kind, api_key=ns.api_key,
                        ignore_eos=not ns.no_ignore_eos, slo_ttft_ms=ns.slo_ttft_ms,
                        slo_tpot_ms=ns.slo_tpot_ms, seed=ns.seed, progress=not ns.no_progress)
    result, results = run_serve(workload, opts)
    print_serve_summary(result)
    write_json(result, ns.json)
    if ns.plot:
        ok = [r for r in results if r.ok]
        dists = {label: {"server": [getattr(r, attr) * 1e3 for r in ok if getattr(r, attr) is not None]}
                 for label, attr in (("TTFT (ms)", "ttft"), ("TPOT (ms)", "tpot"), ("E2E (ms)", "e2e"))}
        dists["ITL (ms)"] = {"server": [x * 1e3 for r in ok for x in r.itls]}
        plot_bench(ns.plot, f"serve {ns.url} at {ns.request_rate} req/s",
                   {"output tok/s": result["output_token_throughput"],
                    "goodput req/s": result["goodput_requests_per_s"]}, "per second", dists)
    return 0 if result["completed"] else 1


def add_bench_parsers(sub, add_engine_args: AddEngineArgs, engine_args_from: EngineArgsFrom) -> None:
    """Register ``bench`` (throughput / latency / serve) and ``profile`` on ``sub``."""
    cmd_throughput, cmd_latency, cmd_profile = make_commands(engine_args_from)

    bench = sub.add_parser("bench", help="benchmarks: throughput | latency | serve")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    p = bench_sub.add_parser("throughput", help="offline throughput of a workload (W1, W2, W4)")
    add_engine_args(p)
    _add_workload_args(p, "W1")
    _add_compare_args(p)
    _add_output_args(p)
    p.set_defaults(func=cmd_throughput)

    p = bench_sub.add_parser("latency", help="batch-1 TTFT/TPOT (W3) and a prefill sweep")
    add_engine_args(p)
    _add_workload_args(p, "W3", with_input=False)
    p.add_argument("--num-iters", type=int, default=1, help="single-stream runs (fresh prompt each)")
    p.add_argument("--prefill-lens", type=_int_list, default=None,
                   help="prompt lengths of the prefill sweep (default 128,256,512,1024,2048)")
    _add_compare_args(p)
    _add_output_args(p)
    p.set_defaults(func=cmd_latency)

    p = bench_sub.add_parser("serve", help="online load against an OpenAI-compatible server")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model", default=None, help="model name to send (default: first of /v1/models)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--prompt-kind", choices=("tokens", "text"), default="tokens",
                   help="tokens: prompts as token-id lists; text: random words (any server)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject unknown fields)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--vocab-size", type=int, default=49152, help="range of the random prompt tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    _add_workload_args(p, "W1")
    _add_output_args(p)
    p.set_defaults(func=cmd_serve_bench)

    p = sub.add_parser("profile", help="torch.profiler over a workload: time by category + trace")
    add_engine_args(p)
    _add_workload_args(p, "W1", with_input=False)
    p.add_argument("--trace", default="kvserve.trace.json", help="Chrome trace file ('' for none)")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_profile)

