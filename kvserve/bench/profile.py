"""``kvserve profile``: torch.profiler over a workload, time by category, a Chrome trace.

Categories come from the ``record_function`` labels the step loop carries (engine, runner,
attention) and from the aten ops inside the forward pass, never from guesses:

    engine.step                     everything the engine does in one step
      model.forward.prefill/decode  the forward pass, split into
        attention                   the ``attention`` label (or an SDPA op outside it)
        latent attention            MLA's ``latent attention`` label (DeepSeek; cache write,
                                    absorbed decode, expanded prefill)
        router                      the ``router`` label (MoE: logits and top-k)
        experts                     the ``experts`` label (MoE: the routed experts' matmuls)
        linear layers               aten linear / matmul ops outside the labels above
        other ops                   norms, RoPE, activations, embedding, copies
      draft model                   a draft_model drafter's forward passes and sampling
      sampler                       logits -> token ids (and the host copy)
      scheduler.* + runner.prepare_inputs   scheduling and batch building
      detokenizer                   detokenization, stop strings, output assembly
      other step overhead           the rest of engine.step
    idle                            wall time outside engine.step (the driver's own loop)

Beside it, outside the profiler, decode at the memory limit: one 256-token prompt decoding
128 greedy tokens, its bytes per token (``decode_bytes``) / TPOT against the machine's read
bandwidth measured in the same run (``memory_bandwidth``).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

from kvserve.bench.decode_bytes import summary_bandwidth_use
from kvserve.bench.memory_bandwidth import measure_read_bandwidth
from kvserve.bench.report import bandwidth_line
from kvserve.bench.workloads import Workload, WorkloadSpec, build_workload

if TYPE_CHECKING:
    from kvserve.bench.kvserve_driver import KvserveDriver

STEP = "engine.step"
FORWARD = {"model.forward.prefill": "prefill forward", "model.forward.decode": "decode forward"}
STEP_PARTS = {
    "sampler": "sampler",
    "runner.prepare_inputs": "scheduler and batch building",
    "scheduler.schedule": "scheduler and batch building",
    "scheduler.update": "scheduler and batch building",
    "detokenizer": "detokenizer",
    "spec.propose": "scheduler and batch building",
    "spec.draft_model": "draft model",
}
ATTENTION_LABEL = "attention"
# Labels of architecture-specific parts of the forward pass, each its own row per phase
# (kvserve/latent_attention.py, models/moe.py and the MoE blocks' routers).
PART_LABELS = ("latent attention", "router", "experts")
ATTENTION_OPS = {"aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_efficient_attention", "aten::_flash_attention_forward"}
LINEAR_OPS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm",
              "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm",
              "aten::_weight_int4pack_mm_for_cpu", "aten::_addmm_activation",
              "mkldnn::_linear_pointwise",  # Bf16Linear's pre-packed oneDNN matmul
              "kvserve::q4_linear", "kvserve::q5_linear", "kvserve::q8_linear", "kvserve::bf16_linear",
              "kvserve::fp32_linear"}  # labels of kvserve's own kernels (their *_linear_out)

# The rows inside a forward pass, per phase; "other ops" is the rest of it.
FORWARD_KINDS = ("attention", *PART_LABELS, "linear layers", "other ops")
ROW_ORDER = [*(row for phase in ("prefill", "decode")
               for row in (f"{phase} forward", *(f"  {kind} ({phase})" for kind in FORWARD_KINDS))),
             "draft model", "sampler", "scheduler and batch building", "detokenizer", "other step overhead", "idle"]


@dataclass
class _Event:
    name: str
    start: float  # microseconds
    end: float
    parent: Optional["_Event"]

    @property
    def duration(self) -> float:
        return self.end - self.start


def _kind(name: str) -> Optional[str]:
    if name == ATTENTION_LABEL or name in ATTENTION_OPS:
        return "attention"
    if name in PART_LABELS:
        return name
    if name in LINEAR_OPS:
        return "linear layers"
    return None


def categorize(events: Iterable, wall_us: float) -> dict[str, float]:
    """Seconds by category from profiler events (``prof.events()``): each event is counted
    once, at its outermost labelled occurrence, so nested ops are never double counted."""
    converted: dict[int, _Event] = {}
    ordered = []

    def convert(e) -> _Event:
        key = id(e)
        if key not in converted:
            parent = convert(e.cpu_parent) if e.cpu_parent is not None else None
            converted[key] = _Event(e.name, e.time_range.start, e.time_range.end, parent)
        return converted[key]

    for e in events:
        ordered.append(convert(e))

    totals: dict[str, float] = defaultdict(float)
    for ev in ordered:
        ancestors = []
        p = ev.parent
        while p is not None:
            ancestors.append(p)
            p = p.parent
        names = [a.name for a in ancestors]
        if ev.name == STEP and STEP not in names:
            totals["engine.step"] += ev.duration
            continue
        if STEP not in names:
            continue
        if ev.name in FORWARD and not any(n in FORWARD for n in names):
            totals[FORWARD[ev.name]] += ev.duration
            continue
        if ev.name in STEP_PARTS and not any(n in STEP_PARTS or n in FORWARD for n in names):
            totals[STEP_PARTS[ev.name]] += ev.duration
            continue
        kind = _kind(ev.name)
        forward = next((FORWARD[n] for n in names if n in FORWARD), None)
        if kind is None or forward is None:
            continue
        # Outermost only: an mm inside a linear, or a matmul inside attention, is already counted.
        if any(_kind(n) is not None for n in names):
            continue
        phase = forward.split()[0]
        totals[f"  {kind} ({phase})"] += ev.duration

    for phase in ("prefill", "decode"):
        inner = sum(totals[f"  {kind} ({phase})"] for kind in FORWARD_KINDS if kind != "other ops")
        totals[f"  other ops ({phase})"] = max(0.0, totals[f"{phase} forward"] - inner)
    top = sum(totals[k] for k in ("prefill forward", "decode forward", "draft model", "sampler",
                                  "scheduler and batch building", "detokenizer"))
    totals["other step overhead"] = max(0.0, totals["engine.step"] - top)
    totals["idle"] = max(0.0, wall_us - totals["engine.step"])
    return {k: totals[k] / 1e6 for k in ROW_ORDER}


def category_table(seconds: dict[str, float], wall_s: float) -> str:
    lines = [f"{'category':<34} {'time s':>9} {'% of wall':>10}", "-" * 55]
    for name in ROW_ORDER:
        if name.strip().startswith(PART_LABELS) and not seconds[name]:
            continue  # an architecture without that part (dense MLP, per-head attention)
        lines.append(f"{name:<34} {seconds[name]:>9.3f} {100 * seconds[name] / wall_s:>9.1f}%")
    lines.append(f"{'wall':<34} {wall_s:>9.3f} {100.0:>9.1f}%")
    return "\n".join(lines)


def top_ops(prof, n: int = 12) -> list[dict]:
    """The aten ops with the most self CPU time (where the time is actually spent)."""
    rows = [a for a in prof.key_averages() if a.key.startswith("aten::")]
    rows.sort(key=lambda a: a.self_cpu_time_total, reverse=True)
    return [{"op": a.key, "self_cpu_s": a.self_cpu_time_total / 1e6, "calls": a.count}
            for a in rows[:n]]


# W3's shape, shorter: enough decode steps for a stable mean TPOT.
BANDWIDTH_PROBE = WorkloadSpec("decode-probe", "single stream", num_requests=1, prompt_len=(256, 256),
                               output_len=128, seed=4242)


def decode_bandwidth_probe(driver: "KvserveDriver") -> Optional[dict]:
    """A batch-1 decode's bytes per token / TPOT against the read bandwidth, both measured
    now, unprofiled (None where the weights are not in this process)."""
    if driver.decode_bytes is None or driver.engine.device.type != "cpu":
        return None
    run = driver.run(build_workload(BANDWIDTH_PROBE, driver.vocab_size), progress=False)
    use = summary_bandwidth_use(run.summary(), measure_read_bandwidth().gbs)
    return None if use is None else {**use, "workload": BANDWIDTH_PROBE.description}


def run_profile(driver: "KvserveDriver", workload: Workload, trace_path: Optional[str],
                progress: bool = True) -> dict:
    driver.warmup()
    bandwidth = decode_bandwidth_probe(driver)
    activities = [ProfilerActivity.CPU]
    if driver.engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run = driver.run(workload, progress=progress)
        wall_s = time.perf_counter() - t0
    if trace_path:
        prof.export_chrome_trace(trace_path)
    seconds = categorize(prof.events(), wall_s * 1e6)
    spec = {k: v for k, v in run.extra.items() if k.startswith("spec_")}
    return {"speculative": spec or None,"command": "profile", "model": driver.eargs.model,
            "dtype": str(driver.engine.dtype).removeprefix("torch."),
            "num_threads": torch.get_num_threads(), "workload": workload.describe(),
            "wall_s": wall_s, "categories_s": seconds,
            "categories_fraction": {k: v / wall_s for k, v in seconds.items()},
            "top_ops": top_ops(prof), "trace": trace_path,
            "output_tokens_per_s_under_profiler": run.summary()["output_tokens_per_s"],
            "weights": driver.engine.weight_format, "decode_bandwidth": bandwidth}


def print_profile(result: dict) -> None:
    w = result["workload"]
    print(f"\n== profile: {w['name']} — {w['description']} ({result['model']}, {result['dtype']}, "
          f"{result['num_threads']} threads)")
    print(category_table(result["categories_s"], result["wall_s"]))
    print("top aten ops by self CPU time:")
    for row in result["top_ops"]:
        print(f"  {row['op']:<44} {row['self_cpu_s']:>8.3f} s  {row['calls']:>7} calls")
    spec = result.get("speculative")
    if spec:
        print(f"speculative decoding: {spec['spec_draft_tokens']} drafted, "
              f"{spec['spec_accepted_tokens']} accepted ({100 * spec['spec_acceptance_rate']:.1f} %), "
              f"mean accepted length {spec['spec_mean_accepted_length']:.2f} tokens per verify step")
    if result.get("decode_bandwidth"):
        use = result["decode_bandwidth"]
        print(f"decode at the memory limit ({use['workload']}, unprofiled):\n  "
              + bandwidth_line(f"kvserve ({result.get('weights')} weights)", use))
    if result["trace"]:
        print(f"Chrome trace: {result['trace']} (open in chrome://tracing or ui.perfetto.dev)")
    print("(times are under the profiler, which slows op-heavy code; compare categories, "
          "not absolute speed)")
