"""Where a single-stream decode step's time goes, per token: the engine's parts (scheduler,
input preparation, sampler, output processing) and the model's (embedding, decoder layers,
final norm, LM head), timed with perf_counter wrappers (no profiler: its per-op cost would
swamp a ~10 ms step), over the decode steps of one greedy request. The decoder layers are
split further, in a second run under the profiler, into the native loop's kernel ranges (the
linear layers' kernels, attention) and the rest. The parts are those of the step through the
model in Python; by default a greedy argmax-only decode step is one native call (model, final
norm, the head's argmax), timed after them.

    python benchmarks/decode_step_breakdown.py [--model gemma-3-270m] [--quantization int4]
"""
from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict

import torch

from kvserve import ops
from kvserve.bench.workloads import load_text
from kvserve.config import EngineArgs
from kvserve.engine import LLMEngine
from kvserve.request import SamplingParams

ENGINE_PARTS = {  # (attribute path from the engine, method) -> part
    ("scheduler", "schedule"): "scheduler.schedule",
    ("executor.runner", "prepare_inputs"): "runner.prepare_inputs",
    ("executor.runner.model.model", "forward"): "decoder (embedding, rope, layers)",
    ("executor.runner.model.model.norm", "forward"): "final norm",
    ("executor.runner.model.lm_head", "forward"): "LM head (screen or fast head, + fp32 rescoring)",
    ("executor.runner.model.lm_head", "argmax_tokens"): "LM head's argmax (screen, fp32 rescoring, argmax)",
    ("executor.runner", "sampler"): "sampler",
    ("scheduler", "update_from_output"): "scheduler.update (stops, detokenizer)",
}


LM_HEAD_RANGE = "breakdown.lm_head"


def _resolve(engine: LLMEngine, path: str):
    owner = engine
    for name in path.split("."):
        owner = getattr(owner, name, None)
        if owner is None:
            return None
    return owner


def instrument(engine: LLMEngine, acc: dict, parts: dict) -> None:
    """Wrap each ``parts`` method ((dotted attribute path from the engine, method) -> name) so
    that its time adds to ``acc[name]``; parts the engine lacks are skipped."""
    for (path, method), part in parts.items():
        owner = _resolve(engine, path)
        fn = None if owner is None else getattr(owner, method, None)
        if fn is None:
            continue

        def timed(*a, __fn=fn, __part=part, **kw):
            t0 = time.perf_counter()
            try:
                return __fn(*a, **kw)
            finally:
                acc[__part] += time.perf_counter() - t0

        # An instance attribute shadows the class's method (and nn.Module.__call__ finds it).
        object.__setattr__(owner, method, timed)


def timed_steps(engine: LLMEngine, prompt: list[int], n_out: int, parts: dict,
                tokens_per_step: int = 1) -> tuple[dict, int, float]:
    """One greedy request to the end; for its steps that decode ``tokens_per_step`` tokens and
    prefill none: (mean seconds per part, number of such steps, mean seconds per step)."""
    acc: dict = defaultdict(float)
    instrument(engine, acc, parts)
    engine.add_request(f"r{time.monotonic_ns()}", prompt,
                       SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    return step_to_the_end(engine, acc, tokens_per_step)


def step_to_the_end(engine: LLMEngine, acc: dict, decode_tokens: int) -> tuple[dict, int, float]:
    """Step until the engine's requests are done, ``acc`` (instrument's, cleared before each
    step) totalled over the steps that decode ``decode_tokens`` tokens and prefill none: (mean
    seconds per part, number of such steps, mean seconds per step)."""
    totals: dict = defaultdict(float)
    steps, step_time = 0, 0.0
    while engine.has_unfinished_requests():
        acc.clear()
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        last = engine.counters.step_history[-1]
        if last.num_prefill_tokens == 0 and last.num_decode_tokens == decode_tokens:
            steps += 1
            step_time += dt
            for k, v in acc.items():
                totals[k] += v
    return {k: v / steps for k, v in totals.items()}, steps, step_time / steps


def print_parts(parts: dict, names, mean: float, rest: str = "rest of the step (outputs, bookkeeping)") -> None:
    """One line per part of ``names`` that was timed (ms per step and share), then the rest."""
    for part in names:
        if part in parts:
            print(f"    {part:<52} {1e3 * parts[part]:7.2f} ms  {100 * parts[part] / mean:5.1f} %")
    left = mean - sum(parts.values())
    print(f"    {rest:<52} {1e3 * left:7.2f} ms  {100 * left / mean:5.1f} %")


def decode_steps(engine: LLMEngine, prompt: list[int], n_out: int) -> tuple[dict, int, float]:
    return timed_steps(engine, prompt, n_out, ENGINE_PARTS)


def native_kernel_times(engine: LLMEngine, prompt: list[int], n_out: int = 32) -> dict[str, float]:
    """Seconds per decode step inside the native layer loop's kernels (its RECORD_FUNCTION
    ranges: the linear layers' kernels, attention), from the profiler over ``n_out`` steps. The
    LM head's kernel carries the same label as the layers' (``kvserve::q8_linear``...): it is
    run under a range of its own here and left out. The profiler adds a little to each range;
    the split, not the sum, is what it is for."""
    from torch.profiler import ProfilerActivity, profile, record_function

    head = _resolve(engine, "executor.runner.model.lm_head")
    originals = {name: getattr(head, name) for name in ("forward", "argmax_tokens") if hasattr(head, name)}

    def labelled(method):
        def run(*a, **kw):
            with record_function(LM_HEAD_RANGE):
                return method(*a, **kw)
        return run

    for name, method in originals.items():
        object.__setattr__(head, name, labelled(method))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _, steps, _ = decode_steps(engine, prompt, n_out)
    finally:
        for name, method in originals.items():
            object.__setattr__(head, name, method)
    times: dict[str, float] = defaultdict(float)
    for event in prof.events():
        name = event.name
        if name.startswith("kvserve::") and name.endswith("_linear"):
            kind = "linear layers' kernels"
        elif name == "attention":
            kind = "attention"
        else:
            continue
        parent, in_head = event.cpu_parent, False
        while parent is not None and not in_head:
            in_head, parent = parent.name == LM_HEAD_RANGE, parent.cpu_parent
        if not in_head:
            times[kind] += event.cpu_time_total * 1e-6
    return {k: v / steps for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--text", default="code_continue")
    ap.add_argument("--output-len", type=int, default=128)
    ns = ap.parse_args()
    engine = LLMEngine(EngineArgs(model=ns.model, quantization=ns.quantization or None,
                                  kv_cache_memory=128 << 20))
    prompt = engine.tokenizer.encode(load_text(ns.text))[:256]
    # A greedy argmax-only decode step runs as one native call by default (the model, the final
    # norm and the head's argmax: PagedCausalLM.decode_round), whose parts Python cannot time:
    # the parts below are those of the same step through the model in Python.
    runner = engine.executor.runner
    runner.native_rounds = False
    decode_steps(engine, prompt, 16)  # warm-up
    parts, steps, mean = decode_steps(engine, prompt, ns.output_len)
    print(f"{ns.model} ({ns.quantization or 'default'} weights), {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}: {steps} decode steps after a {len(prompt)}-token "
          f"prompt, {1e3 * mean:.2f} ms per step")
    for part in ENGINE_PARTS.values():
        if part in parts:
            print(f"    {part:<52} {1e3 * parts[part]:7.2f} ms  {100 * parts[part] / mean:5.1f} %")
            if part.startswith("decoder"):
                inside = native_kernel_times(engine, prompt)
                for name, seconds in inside.items():
                    print(f"      {'of which ' + name + ' (profiler)':<50} {1e3 * seconds:7.2f} ms")
                rest = parts[part] - sum(inside.values())
                print(f"      {'of which the rest (norms, rope, the loop)':<50} {1e3 * rest:7.2f} ms")
    rest = mean - sum(parts.values())
    print(f"    {'rest of the step (outputs, bookkeeping)':<52} {1e3 * rest:7.2f} ms  {100 * rest / mean:5.1f} %")
    runner.native_rounds = True
    native = decode_steps(engine, prompt, ns.output_len)[2]
    print(f"  the same steps as one native call each (the default): {1e3 * native:.2f} ms per step")
    print_step_teams(engine, prompt, ns.output_len)


def print_step_teams(engine: LLMEngine, prompt: list[int], n_out: int, rounds: int = 3) -> None:
    """What a step team (csrc/step_team.h) saves: an empty parallel call's cost in a team and as
    its own OpenMP region, and the mean decode step with teams off and on, alternated."""
    ext = ops.load_extension()
    if ext is None:
        return
    teamed, alone = (ext.step_team_empty_call_seconds(5000, in_team) for in_team in (True, False))
    print(f"  a parallel call (empty body): {1e6 * teamed:.2f} us in a step team, {1e6 * alone:.2f} us as its own "
          f"OpenMP region")
    before = ext.step_teams_enabled()
    means: dict[bool, list[float]] = {False: [], True: []}
    try:
        for r in range(rounds):
            for enabled in ((False, True) if r % 2 == 0 else (True, False)):
                ext.set_step_teams(enabled)
                means[enabled].append(decode_steps(engine, prompt, n_out)[2])
    finally:
        ext.set_step_teams(before)
    off, on = (1e3 * min(means[enabled]) for enabled in (False, True))
    print(f"  decode step, best of {rounds} alternated: step teams off {off:.2f} ms, on {on:.2f} ms ({on / off:.3f}x)")


if __name__ == "__main__":
    main()
