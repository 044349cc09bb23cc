"""Multi-step decoding (EngineArgs.num_scheduler_steps): rounds of several decode steps give
every request the tokens, text and finish it gets one step at a time, whatever stops it (EOS,
a stop string, max_tokens in the middle of a round), greedy or sampled with a seed, with other
requests arriving, with logprob or penalty requests among them (their rounds take one step),
after preemption, and over prefix-cache hits of its output."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve.config import ConfigError, EngineArgs
from kvserve.llm import LLM
from kvserve.request import SamplingParams

STEPS = 8


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 900) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def _results(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gemma3", "tiny-gemma3-swa"])
def engines(request):
    """One engine a step at a time, one with rounds of STEPS (tiny-gemma3: KV groups of its own
    for the sliding-window layers; -swa: a 32-token window, so blocks are released mid-request)."""
    kwargs = dict(model=request.param, dtype="float32", kv_cache_memory=16 << 20)
    return LLM(**kwargs), LLM(**kwargs, num_scheduler_steps=STEPS)


def _recorded_logits(llm: LLM, prompts, params) -> list:
    """Every logits tensor the runner's sampler was handed while ``llm`` generated (the exact
    fp32 values of the candidates it ranked): a KV slot, position or length off by one in a
    round moves them, where the tiny models' tokens may not move."""
    runner = llm.engine.executor.runner
    sampler, seen = runner.sampler, []

    def recording(logits, md):
        seen.append(logits.clone())
        return sampler(logits, md)

    runner.sampler = recording
    try:
        outs = llm.generate(prompts, params)
    finally:
        runner.sampler = sampler
    return seen, outs


def test_rounds_compute_the_same_logits_tokens_text_and_finish(engines):
    single, multi = engines
    prompts = _prompts(6, seed=1)
    # max_tokens not multiples of the round, EOS honoured (it may end some early).
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2, 9, 17, 31, 40)]
    steps_before = multi.engine.counters.steps
    expected_logits, expected = _recorded_logits(single, prompts, params)
    logits, got = _recorded_logits(multi, prompts, params)
    assert _results(got) == _results(expected)
    # Every step samples (a round's later steps too), from the same rows: the same bits.
    assert len(logits) == len(expected_logits)
    for step, (a, b) in enumerate(zip(expected_logits, logits)):
        assert torch.equal(a, b), f"step {step}"
    assert multi.engine.counters.steps - steps_before < len(expected_logits) // 2


def test_a_stop_in_the_middle_of_a_round_ends_the_request_there(engines):
    single, multi = engines
    prompts = _prompts(8, seed=6)
    # Seeded sampling at a high temperature gives the tiny models varied tokens (at 1.0 they
    # repeat one): find a token
    # whose first appearance falls strictly inside a round (round r covers outputs 8r-7..8r).
    base = [SamplingParams(temperature=50.0, seed=3 + i, max_tokens=40, ignore_eos=True) for i in range(len(prompts))]
    for prompt, params, out in zip(prompts, base, single.generate(prompts, base)):
        tokens = out.outputs[0].token_ids
        inside = [k for k in range(2, len(tokens)) if k % STEPS not in (0, 1) and tokens[k] not in tokens[:k]]
        if inside:
            k = inside[0]
            break
    else:
        pytest.fail("no token first seen inside a round")
    stop = SamplingParams(temperature=50.0, seed=params.seed, max_tokens=40, stop_token_ids=[tokens[k]])
    expected = _results(single.generate([prompt], stop))
    assert expected[0][2] == "stop" and len(expected[0][0]) in (k, k + 1)
    assert _results(multi.generate([prompt], stop)) == expected
    # A stop string there too.
    text = out.outputs[0].text
    cut = multi.engine.tokenizer.decode(tokens[:k + 1])
    if len(cut) > len(multi.engine.tokenizer.decode(tokens[:k])) and cut in text:
        stop_text = SamplingParams(temperature=50.0, seed=params.seed, max_tokens=40, stop=[cut[-2:]])
        assert _results(multi.generate([prompt], stop_text)) == _results(single.generate([prompt], stop_text))


def test_sampled_requests_draw_the_same_tokens_in_rounds(engines):
    single, multi = engines
    prompts = _prompts(4, seed=5)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i, max_tokens=23, ignore_eos=True)
              for i in range(3)] + [SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)]
    steps_before = multi.engine.counters.steps
    assert _results(multi.generate(prompts, params)) == _results(single.generate(prompts, params))
    assert multi.engine.counters.steps - steps_before <= 1 + 23 // STEPS + 1


def test_rounds_beside_logprob_and_penalty_requests_and_arrivals(engines):
    single, multi = engines
    prompts = _prompts(5, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True)
    penalised = SamplingParams(temperature=0.9, seed=7, max_tokens=6, presence_penalty=0.5, ignore_eos=True)
    params = [greedy, with_logprobs, greedy, penalised, greedy]
    expected = single.generate(prompts, params)
    got = multi.generate(prompts, params)
    assert _results(got) == _results(expected)
    assert got[1].outputs[0].logprobs == expected[1].outputs[0].logprobs
    # A request arriving while another decodes in rounds (the engine stepped by hand).
    finals = []
    for llm in engines:
        engine, final = llm.engine, {}
        engine.add_request("first", prompts[0], greedy)
        for _ in range(3):
            engine.step()
        engine.add_request("second", prompts[1], greedy)
        while engine.has_unfinished_requests():
            final.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
        finals.append(final)
    assert finals[0] == finals[1] and len(finals[0]) == 2


def test_rounds_after_preemption_and_over_cached_output(engines):
    single, multi = engines
    prompts = _prompts(4, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = _results(single.generate(prompts, greedy))
    # A pool too small for all four at once: requests are preempted and recomputed.
    kv = multi.engine.kv_manager
    longest = max(len(p) for p in prompts) + greedy.max_tokens
    room = kv.max_blocks_for(longest, multi.engine.args.max_num_batched_tokens) + 2 * kv.num_groups
    small = LLM(model=multi.engine.args.model, dtype="float32", num_blocks=room, num_scheduler_steps=STEPS)
    assert _results(small.generate(prompts, greedy)) == expected
    assert small.engine.scheduler.num_preemptions > 0
    # A next turn over the cached output of a request that ran in rounds: the blocks its rounds
    # filled are found as one step at a time finds them, and the result is the same as cold.
    follow = prompts[0] + list(expected[0][0]) + [5, 6, 7]
    hits = []
    for llm in engines:
        llm.engine.kv_manager.reset_prefix_cache()
        llm.generate([prompts[0]], greedy)
        before = llm.engine.kv_manager.prefix_cache_hits
        hits.append((_results(llm.generate([follow], greedy)), llm.engine.kv_manager.prefix_cache_hits - before))
    assert hits[0] == hits[1] and hits[1][1] > len(prompts[0]) // 2
    multi.engine.kv_manager.reset_prefix_cache()
    assert _results(multi.generate([follow], greedy)) == hits[0][0]


def test_streams_get_every_token_in_order(engines):
    single, multi = engines
    prompt = _prompts(1, seed=4)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    chunks = list(multi.stream(prompt, greedy))
    assert chunks[-1].outputs[0].token_ids == single.generate([prompt], greedy)[0].outputs[0].token_ids
    assert len(chunks) < 21  # bursts: several tokens an output


def test_num_scheduler_steps_is_checked():
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        EngineArgs(model="tiny-llama", num_scheduler_steps=0).validate()


@pytest.mark.parametrize("quantization", ["bf16", "int4"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3", "tiny-gemma3-swa", "tiny-qwen3-moe"])
def test_native_rounds_match_rounds_in_python_and_single_steps(model, quantization):
    """Greedy argmax-only decode steps on the fused layers and the LM head's screen run in one
    native call (PagedCausalLM.decode_round), a step of its own as well as a whole round: the
    same tokens as the steps and rounds stepped through the model in Python, and the same KV
    cache, bit for bit."""
    kwargs = dict(model=model, dtype="float32", quantization=quantization, kv_cache_memory=16 << 20)
    single, native = LLM(**kwargs), LLM(**kwargs, num_scheduler_steps=STEPS)
    single_python, python = LLM(**kwargs), LLM(**kwargs, num_scheduler_steps=STEPS)
    for llm in (single_python, python):
        llm.engine.executor.runner.native_rounds = False
    calls = {}
    for name, llm in (("single", single), ("native", native)):
        model_obj = llm.engine.executor.runner.model

        def counting(num_steps, *args, __run=model_obj.decode_round, __calls=calls.setdefault(name, []), **kw):
            tokens = __run(num_steps, *args, **kw)
            __calls.append((num_steps, None if tokens is None else tokens.numel()))
            return tokens

        model_obj.decode_round = counting
    prompts = _prompts(5, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 12, 19, 33, 40)]
    expected = _results(single_python.generate(prompts, params))
    assert _results(single.generate(prompts, params)) == expected
    assert _results(native.generate(prompts, params)) == expected
    assert _results(python.generate(prompts, params)) == expected
    # Every token after a request's first (its prompt's step: all five prompts share one) came
    # from a native call.
    decoded = sum(len(tokens) for tokens, _, _ in expected) - len(prompts)
    assert all(n == 1 and made is not None for n, made in calls["single"])
    assert sum(made for _, made in calls["single"]) == decoded
    assert all(made is not None for _, made in calls["native"]) and any(n == STEPS for n, _ in calls["native"])
    assert sum(made for _, made in calls["native"]) == decoded
    for pair in ((single, single_python), (native, python)):  # (each pair schedules alike)
        for a, b in zip(*(llm.engine.executor.runner.kv_cache.layers for llm in pair)):
            assert torch.equal(a.data, b.data)
