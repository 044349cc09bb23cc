"""Prefill/decode disaggregation on the engine: a prefill engine and a decode engine in this
process, joined by each connector, against one colocated engine on the same tiny model.

Greedy tokens of random-weight tiny models repeat a lot, so answers are compared with their
logprobs too (the top 3 of every position): those move with every value of the KV, and a
transfer that writes zeros instead of the prefill's KV shows it (the sensitivity test)."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest

from conftest import track_engine
from kvserve import SamplingParams
from kvserve.config import ConfigError, EngineArgs
from kvserve.config.disagg import DisaggConfig
from kvserve.disagg.params import KVTransferParams
from kvserve.engine import LLMEngine
from kvserve.request import RequestRejected

MAX_LEN = 1024
NUM_BLOCKS = 300
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
REMOTE = {"do_remote_decode": True}


def _args(model: str, kv_cache_dtype: str, **kwargs) -> dict:
    return dict(model=model, max_model_len=MAX_LEN, num_blocks=NUM_BLOCKS, kv_cache_dtype=kv_cache_dtype,
                dtype="float32", **kwargs)


_pairs: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _shutdown_pairs():
    yield
    for prefill, decode in _pairs.values():
        prefill.shutdown()
        decode.shutdown()
    _pairs.clear()


def pair(model: str, kv_cache_dtype: str = "auto", connector: str = "shm") -> tuple[LLMEngine, LLMEngine]:
    key = (model, kv_cache_dtype, connector)
    if key not in _pairs:
        engines = tuple(LLMEngine(EngineArgs(**_args(model, kv_cache_dtype),
                                             kv_transfer=DisaggConfig(role=role, connector=connector,
                                                                      load_timeout_s=5.0)))
                        for role in ("prefill", "decode"))
        for engine in engines:
            track_engine(engine)
        _pairs[key] = engines
    return _pairs[key]


def drain(engine: LLMEngine, timeout_s: float = 60.0) -> dict:
    finals = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        assert time.monotonic() < deadline, "engine did not finish"
    return finals


def prefill_then_decode(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int],
                        params: SamplingParams = GREEDY):
    prefill.add_request(rid, prompt, dataclasses.replace(params, kv_transfer_params=REMOTE))
    handed = drain(prefill)[rid]
    assert handed.outputs[0].token_ids[:1] and handed.kv_transfer_params is not None
    decode.add_request(rid, prompt, dataclasses.replace(params, kv_transfer_params=handed.kv_transfer_params))
    return drain(decode)[rid]


def colocated(llm_factory, model: str, kv_cache_dtype: str, prompt: list[int], params: SamplingParams = GREEDY):
    llm = llm_factory(**_args(model, kv_cache_dtype))
    return llm.generate([prompt], params)[0]


def same_answer(a, b) -> None:
    ca, cb = a.outputs[0], b.outputs[0]
    assert ca.token_ids == cb.token_ids
    assert len(ca.logprobs) == len(cb.logprobs) == len(ca.token_ids)
    for la, lb in zip(ca.logprobs, cb.logprobs):
        assert la.keys() == lb.keys()
        for t in la:
            assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("model,kv_cache_dtype,connector", [
    ("tiny-llama", "auto", "shm"),
    ("tiny-llama", "int8", "tcp"),
    ("tiny-gemma3-swa", "bfloat16", "shm"),  # sliding-window groups: only the window moves
    ("tiny-gemma3-swa", "int8", "tcp"),
])
def test_greedy_answers_match_colocated(llm_factory, model, kv_cache_dtype, connector):
    prefill, decode = pair(model, kv_cache_dtype, connector)
    for i, prompt in enumerate(prompts([5, 16, 47, 150])):
        got = prefill_then_decode(prefill, decode, f"r{i}", prompt)
        same_answer(got, colocated(llm_factory, model, kv_cache_dtype, prompt))
    stats = decode.stats()
    assert stats["kv_transfers_loaded"] == 4 and stats["kv_transfers_failed"] == 0
    assert stats["kv_transfer_received_bytes"] == stats["kv_transfer_received_blocks"] * decode.kv_spec.bytes_per_block
    if model == "tiny-gemma3-swa":
        # 150 tokens, window 32, 16-token blocks: every sliding group moves 3 of 10 blocks.
        assert decode.kv_spec.group_windows == [None] + [32] * 5
    deadline = time.monotonic() + 5  # the sweeper notices what a shared-memory consumer took
    while prefill.stats()["kv_transfers_staged"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert prefill.stats()["kv_transfers_staged"] == 0 and prefill.stats()["kv_transfer_staged_bytes"] == 0


def test_sliding_groups_publish_only_their_window():
    prefill, decode = pair("tiny-gemma3-swa", "bfloat16", "shm")
    prompt = prompts([150], seed=3)[0]
    prefill.add_request("w", prompt, dataclasses.replace(GREEDY, kv_transfer_params=REMOTE))
    handed = drain(prefill)["w"].kv_transfer_params
    staged = [tuple(e) for e in handed["staged_blocks"]]
    assert [i for g, i in staged if g == 0] == list(range(10))  # 150 tokens: 10 blocks, all kept
    for g in range(1, 6):  # window 32 from the boundary at 144: blocks 7, 8, 9
        assert [i for gg, i in staged if gg == g] == [7, 8, 9]
    decode.add_request("w", prompt, dataclasses.replace(GREEDY, kv_transfer_params=handed))
    drain(decode)


def test_a_zeroed_transfer_changes_the_answer(llm_factory):
    """The comparison above can fail: the same requests through a transfer that writes zeros."""
    prefill, decode = pair("tiny-llama")
    prompt = prompts([60], seed=1)[0]
    consumer = decode.kv_consumer
    real_write = consumer.write_blocks
    consumer.write_blocks = lambda ids, rows: real_write(ids, rows * 0)
    decode.kv_manager.reset_prefix_cache()
    try:
        got = prefill_then_decode(prefill, decode, "z", prompt)
    finally:
        consumer.write_blocks = real_write
        decode.kv_manager.reset_prefix_cache()  # the zeroed blocks must not serve later tests
    with pytest.raises(AssertionError):
        same_answer(got, colocated(llm_factory, "tiny-llama", "auto", prompt))


def test_a_later_turn_moves_only_the_missing_blocks(llm_factory):
    prefill, decode = pair("tiny-llama", "auto", "tcp")
    decode.kv_manager.reset_prefix_cache()
    first = prompts([100], seed=7)[0]
    turn1 = prefill_then_decode(prefill, decode, "t1", first)
    before = decode.stats()
    # The next turn: the conversation so far (prompt and answer) and a new message.
    second = first + turn1.outputs[0].token_ids + prompts([30], seed=8)[0]
    turn2 = prefill_then_decode(prefill, decode, "t2", second)
    after = decode.stats()
    block_size = decode.kv_spec.block_size
    moved = after["kv_transfer_received_blocks"] - before["kv_transfer_received_blocks"]
    reused = after["kv_transfer_reused_blocks"] - before["kv_transfer_reused_blocks"]
    # 100 + 10 tokens were computed on the decode side: 6 full blocks it still holds.
    assert reused == (100 + 10 - 1) // block_size == 6
    assert moved == -(-len(second) // block_size) - reused
    assert after["kv_transfer_received_bytes"] - before["kv_transfer_received_bytes"] == moved * decode.kv_spec.bytes_per_block
    same_answer(turn2, colocated(llm_factory, "tiny-llama", "auto", second))


def test_first_token_that_ends_the_request_moves_nothing():
    prefill, decode = pair("tiny-llama")
    prompt = prompts([40], seed=2)[0]
    params = dataclasses.replace(GREEDY, max_tokens=1)
    before = prefill.stats()["kv_transfers_published"]
    got = prefill_then_decode(prefill, decode, "one", prompt, params)
    assert len(got.outputs[0].token_ids) == 1 and got.outputs[0].finish_reason == "length"
    assert prefill.stats()["kv_transfers_published"] == before


def test_a_producer_gone_mid_flight_is_re_prefilled_on_the_decode_side(llm_factory):
    prefill, decode = pair("tiny-llama", "auto", "tcp")
    decode.kv_manager.reset_prefix_cache()
    prompt = prompts([80], seed=4)[0]
    prefill.add_request("gone", prompt, dataclasses.replace(GREEDY, kv_transfer_params=REMOTE))
    handed = drain(prefill)["gone"].kv_transfer_params
    prefill.release_transfer(handed["transfer_id"])  # as if the prefill instance had died
    failed = decode.stats()["kv_transfers_failed"]
    decode.add_request("gone", prompt, dataclasses.replace(GREEDY, kv_transfer_params=handed))
    got = drain(decode)["gone"]
    assert decode.stats()["kv_transfers_failed"] == failed + 1
    same_answer(got, colocated(llm_factory, "tiny-llama", "auto", prompt))


def test_an_unreachable_producer_fails_fast_and_re_prefills(llm_factory):
    prefill, decode = pair("tiny-llama", "auto", "tcp")
    prompt = prompts([50], seed=5)[0]
    prefill.add_request("dead", prompt, dataclasses.replace(GREEDY, kv_transfer_params=REMOTE))
    handed = dict(drain(prefill)["dead"].kv_transfer_params)
    prefill.release_transfer(handed["transfer_id"])
    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        handed["address"] = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    decode.add_request("dead", prompt, dataclasses.replace(GREEDY, kv_transfer_params=handed))
    got = drain(decode)["dead"]
    assert time.monotonic() - t0 < 15
    same_answer(got, colocated(llm_factory, "tiny-llama", "auto", prompt))


def test_abort_while_the_kv_is_on_its_way_frees_both_sides():
    prefill, decode = pair("tiny-llama", "auto", "tcp")
    decode.kv_manager.reset_prefix_cache()
    prompt = prompts([200], seed=6)[0]
    prefill.add_request("ab", prompt, dataclasses.replace(GREEDY, kv_transfer_params=REMOTE))
    handed = drain(prefill)["ab"].kv_transfer_params
    decode.add_request("ab", prompt, dataclasses.replace(GREEDY, kv_transfer_params=handed))
    decode.step()  # the transfer starts
    decode.abort_request("ab")
    outputs = drain(decode)
    assert outputs["ab"].outputs[0].finish_reason == "abort"
    assert decode.kv_manager.num_used_blocks == 0 and not decode.kv_consumer.has_pending
    deadline = time.monotonic() + 5
    while prefill.stats()["kv_transfers_staged"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefill.stats()["kv_transfers_staged"] == 0


def test_bad_hand_overs_are_refused_with_a_reason():
    prefill, decode = pair("tiny-llama")
    prompt = prompts([30], seed=9)[0]
    with pytest.raises(RequestRejected, match="not disaggregated|a decode instance"):
        decode.add_request("x", prompt, dataclasses.replace(GREEDY, kv_transfer_params=REMOTE))
    prefill.add_request("x", prompt, dataclasses.replace(GREEDY, kv_transfer_params=REMOTE))
    handed = drain(prefill)["x"].kv_transfer_params
    with pytest.raises(RequestRejected, match="prompt's tokens differ"):
        decode.add_request("x", prompt[:-1] + [5], dataclasses.replace(GREEDY, kv_transfer_params=handed))
    with pytest.raises(RequestRejected, match="KV layout"):
        decode.add_request("x", prompt, dataclasses.replace(GREEDY, kv_transfer_params={**handed, "kv_layout": "other"}))
    with pytest.raises(RequestRejected, match="n = 1"):
        decode.add_request("x", prompt, dataclasses.replace(GREEDY, n=2, kv_transfer_params=handed))
    decode.kv_consumer.release_remote(KVTransferParams.from_json(handed))


def test_disaggregation_refuses_what_it_cannot_serve():
    with pytest.raises(ConfigError, match="tensor or pipeline"):
        EngineArgs(model="tiny-llama", tensor_parallel_size=2, kv_transfer=DisaggConfig(role="decode")).validate()
    with pytest.raises(ConfigError, match="unknown disaggregation role"):
        DisaggConfig(role="both").validate()
