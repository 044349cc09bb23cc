"""The determinism check of issue #15: one request, alone on a cold engine, then 24 copies of
it among 24 unrelated requests, then alone again (its prompt now in the prefix cache), then
streamed, then on engines that split its prompt into chunks or preempt it: how many distinct
(tokens, logprobs) came back. The guarantee is 1.

    python -m kvserve.bench.determinism --model smollm2-135m-instruct --quantization int4
"""
from __future__ import annotations

import argparse
import random
from typing import Any, Callable, Optional

from kvserve.request import RequestOutput, SamplingParams

PROMPT = "Name three colours of the rainbow."
CROWD = 24


def signature(out: RequestOutput) -> tuple:
    """The request's tokens and every logprob entry (token, logprob, rank), bit for bit."""
    completion = out.outputs[0]
    logprobs = tuple(tuple(sorted((t, lp.logprob, lp.rank) for t, lp in step.items()))
                     for step in (completion.logprobs or []))
    return tuple(completion.token_ids), logprobs


def _unrelated_prompts(llm, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    return [[rng.randrange(100, min(vocab, 30000)) for _ in range(rng.randrange(8, 160))] for _ in range(n)]


def preemption_room(kv_spec: Any, other_prompt_lens: list[int], target_tokens: int) -> int:
    """Blocks for the others' prompts and the target's whole request, in every KV cache group
    (a prefill's sliding-window groups hold all of its chunk), plus the null block where there
    are sliding groups: the cache is full once all are admitted, so the others' first decode
    (their prompts end on a block boundary) needs a block and the target, admitted last, is
    the victim."""
    def blocks(n: int) -> int:
        return -(-n // kv_spec.block_size)
    per_group = sum(blocks(n) for n in other_prompt_lens) + blocks(target_tokens)
    return kv_spec.num_groups * per_group + int(kv_spec.has_sliding_groups)


def run_check(make_llm: Callable[..., Any], max_tokens: int = 24, logprobs: int = 5,
              crowd: int = CROWD, prompt: Optional[list[int]] = None) -> dict[str, Any]:
    """``make_llm(**engine_overrides)`` builds an LLM (same model/format/KV dtype each time);
    ``prompt`` (token ids) defaults to PROMPT in the chat template. Returns the signatures
    per scenario and the number of distinct ones."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
    noise = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = make_llm()
    if prompt is None:
        prompt = llm.chat_prompt_ids([{"role": "user", "content": PROMPT}])
    runs: dict[str, list[tuple]] = {}
    runs["alone cold"] = [signature(llm.generate([prompt], params)[0])]
    others = _unrelated_prompts(llm, crowd)
    mixed = [p for pair in zip(others, [prompt] * crowd) for p in pair]
    outs = llm.generate(mixed, [noise, params] * crowd)
    runs["in a crowd"] = [signature(o) for o in outs[1::2]]
    runs["alone warm"] = [signature(llm.generate([prompt], params)[0])]
    streamed = list(llm.stream(prompt, params))
    runs["streamed"] = [signature(streamed[-1])]
    chunked = make_llm(max_num_batched_tokens=16, enable_prefix_caching=False)
    runs["chunked 16"] = [signature(o) for o in chunked.generate([others[0], prompt, others[1]], [noise, params, noise])[1:2]]
    # Room for the target's whole request and the others' prompts, filled to the last slot
    # (lengths a multiple of the block size): the others' first decode needs a block, and
    # the target, admitted last, is the victim, preempted and recomputed.
    rng = random.Random(1)
    group = [[rng.randrange(100, 30000) for _ in range(n)] for n in (32, 48, 64)] + [prompt]
    growing = SamplingParams(temperature=0.0, max_tokens=max_tokens + 48, ignore_eos=True)

    room = preemption_room(llm.engine.kv_spec, [len(p) for p in group[:-1]], len(prompt) + max_tokens)
    small = make_llm(num_blocks=room, enable_prefix_caching=False)
    outs = small.generate(group, [growing] * 3 + [params])
    runs["preempted"] = [signature(outs[-1])]
    distinct = {sig for sigs in runs.values() for sig in sigs}
    return {"runs": runs, "distinct": len(distinct), "preemptions": small.engine.scheduler.num_preemptions,
            "num_runs": sum(len(v) for v in runs.values())}


def main(argv: list[str] | None = None) -> None:
    from kvserve.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="a prompt of this many random tokens instead of the chat prompt (e.g. past a sliding window)")
    args = parser.parse_args(argv)
    base = dict(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=256 << 20)
    if args.quantization:
        base["quantization"] = args.quantization

    def make_llm(**overrides):
        kwargs = {**base, **overrides}
        if "num_blocks" in kwargs:
            kwargs.pop("kv_cache_memory")
        return LLM(**kwargs)

    prompt = None
    if args.prompt_tokens:
        rng = random.Random(1)
        prompt = [rng.randrange(100, 30000) for _ in range(args.prompt_tokens)]
    result = run_check(make_llm, max_tokens=args.max_tokens, prompt=prompt)
    first = next(iter(result["runs"].values()))[0]
    for name, sigs in result["runs"].items():
        print(f"{name:12s}: {len(set(sigs))} distinct of {len(sigs)}; same as alone cold: {all(s == first for s in sigs)}")
    print(f"{args.model} {args.quantization or args.dtype} kv={args.kv_cache_dtype}: "
          f"{result['distinct']} distinct (tokens, logprobs) over {result['num_runs']} runs "
          f"({result['preemptions']} preemptions)")


if __name__ == "__main__":
    main()
