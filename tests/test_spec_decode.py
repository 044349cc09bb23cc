"""Speculative decoding end to end: lossless greedy on the real models (alone, batched, with
prefix hits and preemption), stops / logprobs / streaming when several tokens arrive in a
step, and at temperature 1 the distribution of sampled continuations is the target's."""
from __future__ import annotations

import collections
import json

import pytest
import torch

from kvserve.request import SamplingParams

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4})

# Input-grounded prompts: the continuation repeats spans of the prompt, so drafts are
# accepted (several per step) as well as rejected.
CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b
'''
PROMPTS = [
    "Copy this code exactly:\n" + CODE + "\nCopy:\n" + CODE[:30],
    "Copy this code exactly:\n" + CODE + "\nRename fibonacci to fib:\n",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_greedy_with_ngram_is_identical_to_without(llm_factory, model):
    off = llm_factory(model=model, dtype="float32")
    on = llm_factory(model=model, dtype="float32", speculative_config=NGRAM)
    alone = [_tokens(off, [p])[0] for p in PROMPTS]
    before = on.engine.stats()
    assert [_tokens(on, [p])[0] for p in PROMPTS] == alone
    stats = on.engine.stats()
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    drafted = stats["spec_draft_tokens"] - before["spec_draft_tokens"]
    assert accepted > 0
    if model.startswith("smollm2"):
        assert accepted < drafted  # and rejected ones rolled back
    # Batched; the second run hits the prefix cache.
    assert _tokens(on, PROMPTS) == alone
    hits = on.engine.kv_manager.prefix_cache_hits
    assert _tokens(on, PROMPTS) == alone
    assert on.engine.kv_manager.prefix_cache_hits > hits
    # A KV pool too small for all three to grow: preemption (by recompute) while speculating.
    lens = [len(off.tokenizer.encode(p)) for p in PROMPTS]
    num_blocks = max(sum(-(-n // 16) for n in lens), -(-(max(lens) + 24) // 16))
    # Per KV cache group (Gemma: six; these prompts stay inside the sliding window, so every
    # group grows alike), and the null block sliding groups reserve.
    spec = off.engine.kv_spec
    num_blocks = spec.num_groups * num_blocks + int(spec.has_sliding_groups)
    small = llm_factory(model=model, dtype="float32", speculative_config=NGRAM,
                        num_blocks=num_blocks, enable_prefix_caching=False)
    assert _tokens(small, PROMPTS) == alone
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.stats()["spec_accepted_tokens"] > 0


def test_stops_logprobs_and_streaming_when_several_tokens_arrive(llm_factory):
    off = llm_factory(model="smollm2-135m-instruct", dtype="float32")
    on = llm_factory(model="smollm2-135m-instruct", dtype="float32", speculative_config=NGRAM)
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    ref = off.generate(prompt, params)[0].outputs[0]
    got = on.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == ref.token_ids and got.text == ref.text
    assert len(got.logprobs) == len(ref.logprobs) == 24
    for a, b in zip(got.logprobs, ref.logprobs):
        assert a.keys() == b.keys()
        for tok in a:
            assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-3)
            assert a[tok].rank == b[tok].rank
    assert got.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-2)
    # Streaming: deltas add up to the text, and some deltas carry several tokens.
    chunks = list(on.stream(prompt, params))
    assert "".join(c.outputs[0].delta_text for c in chunks) == ref.text
    assert max(len(c.outputs[0].delta_token_ids) for c in chunks) > 1
    # A stop token, a stop string and max_tokens falling inside accepted runs.
    tokens, text = ref.token_ids, ref.text
    stop_tok = tokens[10]
    first = tokens.index(stop_tok)
    for p in (SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[text[40:46]])):
        a = off.generate(prompt, p)[0].outputs[0]
        b = on.generate(prompt, p)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
            a.token_ids, a.text, a.finish_reason, a.stop_reason)
    assert len(on.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                  stop_token_ids=[stop_tok]))[0].outputs[0].token_ids) == first + 1


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def _continuations(llm, prompt, params, n):
    torch.manual_seed(0)  # unseeded rows share the default generator: a deterministic test
    outs = llm.generate([prompt] * n, params)
    counts = collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)
    return {k: v / n for k, v in counts.items()}


def test_temperature_one_samples_the_targets_distribution(llm_factory, monkeypatch):
    # The random-weight model mostly repeats its last token; a logit bias on a second token
    # spreads its continuations of a run of one token over a few sequences, and n-gram
    # drafts (more of the run) are accepted and rejected.
    prompt = [1000] * 16
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logit_bias={12037: 3.0})
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                       "disable_by_batch_size": 1024, "max_backoff_steps": 0})
    n = 1000
    off = llm_factory(model="tiny-llama", max_num_seqs=n)
    on = llm_factory(model="tiny-llama", max_num_seqs=n, speculative_config=spec)
    ref = _continuations(off, prompt, params, n)
    got = _continuations(on, prompt, params, n)
    stats = on.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert sum(p > 0.1 for p in ref.values()) >= 3  # a spread-out distribution
    # Two samples of 1000 from one distribution over a handful of outcomes: TV ~ 0.03.
    assert total_variation(ref, got) < 0.07, (ref, got)
    # The test can fail: accepting every draft skews the distribution towards the drafts.
    import kvserve.executor.runner
    monkeypatch.setattr(kvserve.executor.runner, "accept_run", lambda drafts, target: list(drafts) + [target[-1]])
    assert total_variation(ref, _continuations(on, prompt, params, n)) > 0.2


def test_seeded_sampling_with_drafts_is_reproducible(llm_factory):
    on = llm_factory(model="smollm2-135m-instruct", dtype="float32", speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    first = _tokens(on, [PROMPTS[0]], params)
    assert _tokens(on, [PROMPTS[0]], params) == first


def test_speculative_config_reaches_the_engine_from_every_entry_point():
    from kvserve.cli import build_parser, engine_args_from
    from kvserve.config import ConfigError, EngineArgs
    from kvserve.server.metrics import ServerMetrics
    from kvserve.speculative import SpeculativeConfig

    for command in (["serve"], ["generate", "hi"], ["chat"], ["bench", "throughput"], ["profile"]):
        ns = build_parser().parse_args(command + ["--speculative-config", NGRAM])
        assert engine_args_from(ns).speculative_config == SpeculativeConfig(num_speculative_tokens=4)
    with pytest.raises(ConfigError, match="unknown speculative method"):
        EngineArgs(speculative_config={"method": "eagle"}).validate()
    text = ServerMetrics(lambda: {"spec_draft_tokens": 10, "spec_accepted_tokens": 7, "spec_num_steps": 3,
                                  "spec_mean_accepted_length": 3.33}).render().decode()
    assert "kvserve:spec_decode_num_accepted_tokens_total 7.0" in text
    assert "kvserve:spec_decode_mean_accepted_length 3.33" in text
