"""How many 8,192-token Gemma-3-270M requests run at once at a fixed --kv-cache-memory, with
and without sliding-window KV groups (issue #12). Deterministic: the engine's own sizing
(KVCacheSpec, bytes per block) and its torch-free scheduler and KV manager, driven with fake
sampled tokens; no model is loaded.

    PYTHONPATH=. python benchmarks/swa_capacity.py [--kv-cache-memory 1G] [--requests 64]
"""
from __future__ import annotations

import argparse

from kvserve.cli import _parse_bytes
from kvserve.config import ModelConfig
from kvserve.kv_cache import KVCacheSpec
from kvserve.kv_manager import KVCacheManager, max_blocks_per_request
from kvserve.request import Request, SamplingParams
from kvserve.scheduler import Scheduler


def gemma_270m() -> ModelConfig:
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    return ModelConfig(architecture="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                       num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                       max_position_embeddings=32768, sliding_window=512, layer_types=layer_types)


def simulate(spec: KVCacheSpec, budget_bytes: int, num_requests: int, length: int, max_tokens: int,
             chunk: int) -> dict:
    num_blocks = budget_bytes // spec.bytes_per_block
    kv = KVCacheManager(num_blocks, spec.block_size, True, spec.group_windows)
    sched = Scheduler(kv, chunk, num_requests, length)
    for i in range(num_requests):
        # Distinct prompts (no prefix sharing): every request pays its own KV.
        prompt = [1 + (i * 7919 + t) % 50000 for t in range(length - max_tokens)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    peak_decoding = steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        decoding = sum(1 for c in out.chunks if not c.is_prefill)
        peak_decoding = max(peak_decoding, decoding)
        sched.update_from_output(out, {c.request.request_id: 5 for c in out.chunks if c.needs_sample})
        steps += 1
    per_request = max_blocks_per_request(length, spec.block_size, spec.group_windows, 1)
    return {"num_blocks": num_blocks, "blocks_per_request": per_request,
            "at_once": (num_blocks - int(spec.has_sliding_groups)) // per_request,
            "peak_decoding": peak_decoding, "preemptions": sched.num_preemptions, "steps": steps}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-memory", type=_parse_bytes, default=1 << 30)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-dtype", default="bfloat16")
    args = parser.parse_args(argv)
    results = {}
    for name, reclaim in (("one group (before)", False), ("sliding-window groups", True)):
        spec = KVCacheSpec.for_model(gemma_270m(), 16, args.kv_cache_dtype, reclaim_sliding_window=reclaim)
        r = simulate(spec, args.kv_cache_memory, args.requests, args.length, args.max_tokens,
                     args.max_num_batched_tokens)
        results[name] = r
        print(f"{name:22s}: {spec.num_groups} group(s) of {spec.slots_per_group} layers, "
              f"{spec.bytes_per_block} bytes per block, {r['num_blocks']} blocks; a {args.length}-token request "
              f"holds {r['blocks_per_request']} blocks in decode -> {r['at_once']} at once; simulated "
              f"{args.requests} requests: peak {r['peak_decoding']} decoding together, {r['preemptions']} "
              f"preemptions, {r['steps']} steps")
    before, after = results.values()
    print(f"Gemma-3-270M {args.kv_cache_dtype} KV, --kv-cache-memory {args.kv_cache_memory / 2**30:.2f} GiB: "
          f"{after['at_once']} / {before['at_once']} = {after['at_once'] / before['at_once']:.2f}x requests at once "
          f"(simulated peak {after['peak_decoding']} / {before['peak_decoding']})")


if __name__ == "__main__":
    main()
