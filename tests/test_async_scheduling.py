"""Async scheduling (kvserve/async_step.py) against the synchronous step, both with the model in
a worker process: the same tokens for greedy and seeded sampling, stop strings, EOS, max_tokens,
JSON-schema outputs, preemption in a tiny KV pool and an abort mid-stream; and the steps really
overlap (the next step goes out before the one in flight is collected).

Each engine starts a worker process (seconds on a busy 2-core box): a module-scoped pair serves
most tests, and every engine is shut down before the module ends.
"""
from __future__ import annotations

import json
import logging

import jsonschema
import pytest

from conftest import track_engine
from json_schemas import random_schemas
from kvserve import SamplingParams
from kvserve.config import ConfigError, EngineArgs
from kvserve.config.disagg import DisaggConfig
from kvserve.engine import LLMEngine
from kvserve.structured.params import StructuredOutputsParams

MODEL = "tiny-llama"
PROMPTS = [[1, 5, 9, 200, 3000, 17, 4242, 99], [1] + list(range(300, 340)), [1, 77, 78, 79],
           [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]


def _engine(async_scheduling: bool, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_blocks", 256)
    engine = LLMEngine(EngineArgs(model=MODEL, dtype="float32", max_model_len=512, worker_process=True,
                                  async_scheduling=async_scheduling, distributed_timeout_s=60, **kwargs))
    track_engine(engine)
    return engine


@pytest.fixture(scope="module")
def pair():
    sync, asyn = _engine(False), _engine(True)
    assert sync.async_loop is None and asyn.async_loop is not None
    yield sync, asyn
    sync.shutdown()
    asyn.shutdown()


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]],
         abort_after: dict[str, int] | None = None) -> dict[str, list]:
    """Every request's final outputs (token ids, text, finish reason, logprobs) by id;
    ``abort_after``: request id -> abort it once it has streamed this many tokens."""
    abort_after = dict(abort_after or {})
    ids = [engine.add_request(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]
    finals: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            rid = out.request_id
            if out.finished:
                finals[rid] = [(c.token_ids, c.text, c.finish_reason,
                                [sorted((t, round(lp.logprob, 4)) for t, lp in e.items()) for e in c.logprobs or []])
                               for c in out.outputs]
            elif rid in abort_after and len(out.outputs[0].token_ids) >= abort_after[rid]:
                del abort_after[rid]
                engine.abort_request(rid)  # its final output (finish reason "abort") comes next step
    assert engine.kv_manager.num_used_blocks == 0
    return {rid: finals.get(rid) for rid in ids}


def _overlapped(engine: LLMEngine):
    """Count the steps sent while another was in flight (wraps the executor's submit)."""
    submit = engine.executor.submit
    depths: list[int] = []

    def spy(step):
        depths.append(engine.executor._num_in_flight)
        submit(step)

    engine.executor.submit = spy
    return depths


def test_sampling_stops_and_lengths_match_sync(pair):
    sync, asyn = pair
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = _run(sync, [(PROMPTS[0], free)])["r0"][0][1]
    stop = text[len(text) // 2: len(text) // 2 + 3]  # a stop string inside the free output
    assert stop.strip()
    requests = [
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)),
        (PROMPTS[1], SamplingParams(n=2, temperature=0.9, top_p=0.95, seed=7, max_tokens=20, logprobs=2,
                                    repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=4)),
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])),
        (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=3)),
        (PROMPTS[3], SamplingParams(temperature=1.0, seed=11, max_tokens=40)),  # EOS may come
        (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=1)),
    ]
    want = _run(sync, requests)
    depths = _overlapped(asyn)
    try:
        got = _run(asyn, requests)
    finally:
        del asyn.executor.submit
    assert got == want
    assert want["r2"][0][2] == "stop" and len(want["r2"][0][0]) < 24
    assert sum(1 for d in depths if d == 1) >= 10, depths  # the next step went out before collecting


def test_eos_ends_a_request_with_its_extra_step_discarded(pair):
    """Seeded sampled streams that end with EOS at different steps (EOS pushed up by a logit
    bias, held back by min_tokens until its step): the step already scheduled after each end
    is dropped and its blocks are free."""
    sync, asyn = pair
    eos = sync.eos_token_ids[0]
    requests = [(PROMPTS[i % 4], SamplingParams(temperature=1.0, seed=100 + i, max_tokens=60, min_tokens=2 + i,
                                                logit_bias={eos: 100.0})) for i in range(12)]
    want = _run(sync, requests)
    got = _run(asyn, requests)
    assert got == want
    assert all(out[0][2] == "stop" for out in want.values())
    assert sorted(len(out[0][0]) for out in want.values()) == list(range(3, 15))  # EOS included


def test_json_schema_outputs_match_sync_and_validate(pair):
    sync, asyn = pair
    schemas = random_schemas(6, seed=3)
    requests = [(PROMPTS[i % 4], SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=300,
                                                structured_outputs=StructuredOutputsParams(json=s)))
                for i, s in enumerate(schemas)]
    want = _run(sync, requests)
    got = _run(asyn, requests)
    assert got == want
    for i, schema in enumerate(schemas):
        token_ids, text, reason, _ = got[f"r{i}"][0]
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_abort_mid_stream(pair):
    sync, asyn = pair
    requests = [(PROMPTS[i % 4], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)) for i in range(4)]
    want = _run(sync, requests, abort_after={"r1": 5})
    got = _run(asyn, requests, abort_after={"r1": 5})
    assert got["r1"][0][2] == want["r1"][0][2] == "abort"
    assert len(got["r1"][0][0]) < 30
    assert {k: v for k, v in got.items() if k != "r1"} == {k: v for k, v in want.items() if k != "r1"}
    # The worker has forgotten every request once the next step tells it.
    asyn.executor.execute(asyn.step_builder.build(__import__("kvserve.batch").batch.SchedulerOutput()))
    assert all(s["num_requests"] == 0 for s in asyn.executor.worker_stats())


def test_preemption_in_a_tiny_pool_matches_sync():
    """8 blocks of 16 tokens for 4 requests that grow to ~40 tokens each: requests are preempted
    (only with nothing in flight: the step in flight is collected first) and recomputed."""
    requests = [(PROMPTS[i % 4][:8], SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=32,
                                                    ignore_eos=True)) for i in range(4)]
    sync = _engine(False, num_blocks=9)
    try:
        want = _run(sync, requests)
        assert sync.scheduler.num_preemptions > 0
    finally:
        sync.shutdown()
    asyn = _engine(True, num_blocks=9)
    try:
        got = _run(asyn, requests)
        assert asyn.scheduler.num_preemptions > 0
        assert asyn.async_loop.num_collected_first > 0
    finally:
        asyn.shutdown()
    assert got == want


def test_falls_back_or_refuses_where_it_cannot_hold(caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert not LLMEngine._async_scheduling_applies(
            EngineArgs(model=MODEL, async_scheduling=True,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2}))
    assert "speculative decoding keeps the synchronous step" in caplog.text
    for parallel in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        assert not LLMEngine._async_scheduling_applies(EngineArgs(model=MODEL, async_scheduling=True, **parallel))
    assert LLMEngine._async_scheduling_applies(EngineArgs(model=MODEL, async_scheduling=True))
    with pytest.raises(ConfigError, match="async scheduling"):
        EngineArgs(model=MODEL, async_scheduling=True, kv_transfer=DisaggConfig(role="prefill")).validate()
