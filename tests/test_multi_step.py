"""Multi-step decoding (EngineArgs.num_scheduler_steps): rounds of several decode steps give
every request the tokens, text and finish it gets one step at a time, whatever stops it (EOS,
a stop string, max_tokens in the middle of a round), greedy or sampled with a seed, with other
requests arriving, with logprob or penalty requests among them (their rounds take one step),
after preemption, and over prefix-cache hits of its output."""
from __future__ import annotations

import random

import pytest

from kvserve.config import ConfigError, EngineArgs
from kvserve.llm import LLM
from kvserve.request import SamplingParams

STEPS = 8


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 900) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def _results(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gemma3"])
def engines(request):
    """One engine a step at a time, one with rounds of STEPS (tiny-gemma3: sliding windows)."""
    kwargs = dict(model=request.param, dtype="float32", kv_cache_memory=16 << 20)
    return LLM(**kwargs), LLM(**kwargs, num_scheduler_steps=STEPS)


def test_rounds_give_the_same_tokens_text_and_finish(engines):
    single, multi = engines
    prompts = _prompts(6, seed=1)
    # max_tokens not multiples of the round; EOS honoured (the tiny models emit it at random).
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2, 9, 17, 31, 40)]
    steps_before = multi.engine.counters.steps
    expected = _results(single.generate(prompts, params))
    assert _results(multi.generate(prompts, params)) == expected
    assert multi.engine.counters.steps - steps_before < sum(p.max_tokens for p in params) // 2
    # A stop string in the middle of a round ends the request where one step at a time does.
    text = expected[5][1]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
    cut = _results(single.generate([prompts[5]], stopped))
    assert cut[0][2] == "stop" and len(cut[0][0]) < 40
    assert _results(multi.generate([prompts[5]], stopped)) == cut


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
    # A next turn over a cached output: the same as cold.
    follow = prompts[0] + list(expected[0][0]) + [5, 6, 7]
    warm = _results(multi.generate([follow], greedy))
    multi.engine.kv_manager.reset_prefix_cache()
    assert _results(multi.generate([follow], greedy)) == warm == _results(single.generate([follow], greedy))


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
