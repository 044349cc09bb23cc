"""MoE decode at batch 1 against a dense model of its active parameters (issue 62's bar: the
routed model's step at most 1.3x the dense one's): whether a decode step reads only the routed
experts' weights, and what running them costs beyond that.

A random-weight Qwen3-MoE-shaped model (48 layers, 128 experts, top 8, Qwen3-30B-A3B's layer
count, expert count, routing and GQA ratio at a small width) against a dense Qwen3 with the
same layers, hidden size and attention and an intermediate size of top_k x moe_intermediate
(the active parameter count: a token reads 8 experts' gate, up and down rows, the dense model
as many in one MLP). Both are built in this process (kvserve.models.testing's random weights),
converted to a weight format and given the native decoder where it applies, as the loader
does, and stepped through the engine's ModelRunner: one greedy request, a 32-token prompt, then
batch-1 decode steps (the runner's native argmax round where the model has one), the two
models' steps alternated; the median step of each, and their ratio.

The default width (hidden 256, experts 128 wide, dense MLP 1024) keeps the 128 x 48 experts
at 604 M weights: 1.2 GB in bf16, built from 2.4 GB of fp32 on a machine of a few GB, and
still 25x the last-level cache, so the experts a step chooses come from memory as the dense
model's weights do. Real Qwen3-30B-A3B's experts are 6x wider (2048 x 768): there each
expert call reads more bytes per call, so a per-call cost weighs less than here.

    python benchmarks/moe_decode.py [--formats default,int4] [--hidden 256 --moe-intermediate 128]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections import defaultdict

import torch

from kvserve import ops
from kvserve.bench.machine import cpu_info
from kvserve.config import ModelConfig
from kvserve.engine import resolve_precision
from kvserve.executor.runner import ModelRunner
from kvserve.executor.step import ChunkInput, NewRequestData, StepInput
from kvserve.kv_cache import KVCacheSpec
from kvserve.loader import return_freed_heap
from kvserve.models.fused import attach_fused_layers
from kvserve.models.testing import build_random_model
from kvserve.quant import convert_linear_layers, use_invariant_fp32_linears
from kvserve.request import SamplingParams

BLOCK_SIZE = 16
PROMPT_LEN = 32


def moe_config(ns: argparse.Namespace) -> ModelConfig:
    """Qwen3-MoE's layer: QK-norm attention (GQA 8:1, as Qwen3-30B-A3B's 32:4), routed experts
    on every layer, softmax top-k renormalised."""
    return ModelConfig(
        architecture="qwen3_moe", vocab_size=49152, hidden_size=ns.hidden, intermediate_size=ns.top_k * ns.moe_intermediate,
        num_hidden_layers=ns.layers, num_attention_heads=ns.heads, num_key_value_heads=ns.kv_heads, head_dim=ns.head_dim,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu", tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=[2], name="qwen3-moe-synthetic", num_experts=ns.experts,
        num_experts_per_tok=ns.top_k, moe_intermediate_size=ns.moe_intermediate, norm_topk_prob=True,
    )


def dense_config(moe: ModelConfig) -> ModelConfig:
    """The same model with one dense MLP of the routed experts' active width."""
    return dataclasses.replace(moe, architecture="qwen3", name="qwen3-dense-active", num_experts=0,
                               num_experts_per_tok=0, moe_intermediate_size=0,
                               intermediate_size=moe.num_experts_per_tok * moe.moe_intermediate_size)


def built(config: ModelConfig, weight_format: str | None) -> torch.nn.Module:
    """The random-weight model as kvserve.loader.load_model leaves one: linear layers in
    ``weight_format`` (int4 without prefill copies: decode rows never read them, and they would
    double the experts' memory), the native decoder attached where it applies."""
    model = build_random_model(config, seed=0)
    if weight_format:
        convert_linear_layers(model, weight_format, None, "blocks")
    else:
        use_invariant_fp32_linears(model)
    attach_fused_layers(model)
    gc.collect()
    return_freed_heap()
    return model


class SingleStream:
    """One greedy request on a model, stepped through the engine's ModelRunner."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, weight_format: str | None, steps: int) -> None:
        blocks = -(-(PROMPT_LEN + steps + 1) // BLOCK_SIZE)
        # The engine's KV dtype for "auto": bf16 beside a converted weight format.
        spec = KVCacheSpec.for_model(config, BLOCK_SIZE, torch.bfloat16 if weight_format else torch.float32)
        self.runner = ModelRunner(model, config, spec, blocks, torch.device("cpu"))
        self.table = [list(range(blocks))]
        prompt = [(7 * i + 11) % config.vocab_size for i in range(PROMPT_LEN)]
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        request = NewRequestData("r", prompt, params, eos_token_ids=[], seed=None)
        out = self.runner.execute(StepInput(chunks=[ChunkInput("r", prompt, 0, self.table, needs_sample=True,
                                                                is_prefill=True)], new_requests=[request]))
        self.tokens = prompt + out.sampled["r"]

    def step(self) -> float:
        """One decode step; its seconds."""
        chunk = ChunkInput("r", [self.tokens[-1]], len(self.tokens) - 1, self.table, needs_sample=True)
        start = time.perf_counter()
        out = self.runner.execute(StepInput(chunks=[chunk]))
        elapsed = time.perf_counter() - start
        self.tokens += out.sampled["r"]
        return elapsed


def compare(moe: ModelConfig, weight_format: str | None, warmup: int, steps: int) -> tuple[dict[str, float], bool]:
    """(median step seconds by name, whether the MoE model runs natively). Natively, the MoE
    stream's steps alternate between its experts side by side (decode-sized steps' default) and
    one after another (each split over the threads by its kernels)."""
    models = {name: built(cfg, weight_format) for name, cfg in (("moe", moe), ("dense", dense_config(moe)))}
    native = models["moe"].model.fused_layers is not None
    ext = ops.load_extension()
    default_rows = ext.expert_parallel_rows() if native else None
    # (what is timed, which stream steps, expert_parallel_rows for the step)
    schedule = [("MoE", "moe", default_rows), ("dense", "dense", None)]
    if native:
        schedule += [("MoE, experts one after another", "moe", 0), ("dense", "dense", None)]
    streams = {name: SingleStream(model, model.config, weight_format, 2 * (warmup + steps))
               for name, model in models.items()}
    times: dict[str, list[float]] = defaultdict(list)
    try:
        for i in range(warmup + steps):
            for name, stream, rows in schedule:  # alternated: each sees the machine's same moments
                if rows is not None:
                    ext.set_expert_parallel_rows(rows)
                elapsed = streams[stream].step()
                if i >= warmup:
                    times[name].append(elapsed)
    finally:
        if native:
            ext.set_expert_parallel_rows(default_rows)
    return {name: statistics.median(t) for name, t in times.items()}, native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="default,int4", help="weight formats: default (the engine's for --dtype auto), "
                    "none (fp32), bf16, int8, int4")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--steps", type=int, default=96)
    ns = ap.parse_args()
    moe = moe_config(ns)
    cpu = cpu_info()
    print(f"{cpu['model']} [{' '.join(cpu['features'])}], {torch.get_num_threads()} threads")
    print(f"MoE: {moe.num_hidden_layers} layers x {moe.num_experts} experts, top {moe.num_experts_per_tok}, hidden "
          f"{moe.hidden_size}, experts {moe.moe_intermediate_size} wide; dense: intermediate "
          f"{moe.num_experts_per_tok * moe.moe_intermediate_size}; heads {moe.num_attention_heads}/"
          f"{moe.num_key_value_heads} x {moe.head_dim}; batch 1, {PROMPT_LEN}-token prompt, median of {ns.steps} "
          f"alternated decode steps")
    for name in ns.formats.split(","):
        if name == "default":
            weight_format = resolve_precision("auto", None, torch.device("cpu"))[1]
        else:
            weight_format = None if name == "none" else name
        medians, native = compare(moe, weight_format, ns.warmup, ns.steps)
        dense = medians["dense"]
        print(f"  {name} ({weight_format or 'fp32'} weights): dense {1e3 * dense:.2f} ms per step")
        for way, seconds in medians.items():
            if way != "dense":
                how = "native decoder" if native else "layer by layer"
                print(f"    {way + f' ({how})':<50} {1e3 * seconds:7.2f} ms  {seconds / dense:.2f}x dense")
        gc.collect()
        return_freed_heap()


if __name__ == "__main__":
    main()
