"""Prefill/decode disaggregation, the torch-free parts alone: which blocks move, the staging
area, the KV manager's received blocks, the consumer's states, the router's instance pool."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import numpy as np
import pytest

from kvserve.disagg.connector import KVConnector, Manifest
from kvserve.disagg.consumer import KVConsumer
from kvserve.disagg.instances import InstanceDown, InstancePool
from kvserve.disagg.params import KVTransferParams, RemoteDecodeRequest, parse_kv_transfer_params, prompt_digest
from kvserve.disagg.plan import KVTransferError, needed_blocks, published_blocks, row_runs, rows_of
from kvserve.disagg.staging import StagedTransfer, StagingArea
from kvserve.disagg.stats import TransferStats
from kvserve.kv_manager import KVCacheManager
from kvserve.request import Request, RequestRejected, SamplingParams


def test_published_blocks_cover_every_group_within_its_window():
    # 40 tokens of 8-token blocks: 5 blocks; a window of 12 seen from position 40 starts at 29.
    assert published_blocks([None], 8, 40) == [(0, i) for i in range(5)]
    assert published_blocks([None, 12], 8, 40) == [(0, i) for i in range(5)] + [(1, 3), (1, 4)]
    # 44 tokens: the window is taken from the last full-block boundary (40), not from 44 (block 4).
    assert published_blocks([None, 12], 8, 44) == [(0, i) for i in range(6)] + [(1, 3), (1, 4), (1, 5)]
    assert needed_blocks([None, 12], 8, 40, num_hit_blocks=4) == [(0, 4), (1, 4)]
    assert needed_blocks([None, 12], 8, 40, num_hit_blocks=0) == published_blocks([None, 12], 8, 40)


def test_rows_and_runs():
    published = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2)]
    assert rows_of(published, [(0, 1), (0, 2), (1, 2)]) == [1, 2, 4]
    assert row_runs([1, 2, 4, 5, 7]) == [(1, 2), (4, 2), (7, 1)]
    with pytest.raises(KVTransferError, match="not published"):
        rows_of(published, [(1, 0)])


def test_staging_expires_evicts_and_releases_once():
    released = []
    area = StagingArea(ttl_s=10.0, capacity_bytes=100)
    for i in range(3):
        area.add(StagedTransfer(f"t{i}", 40, release=lambda i=i: released.append(i)))
    assert released == [0] and area.num_staged == 2 and area.staged_bytes == 80  # over capacity: oldest out
    taken = area.take("t1")
    assert taken is not None and area.take("t1") is None and released == [0]  # the taker releases
    assert area.sweep(now=time.monotonic() + 11) == (0, 1) and released == [0, 2]
    assert area.num_staged == 0 and area.staged_bytes == 0


def test_params_round_trip_and_refusals():
    params = KVTransferParams("shm", "/dev/shm/x", "ab", 5, 10, prompt_digest([1, 2]), "layout", [(0, 1)])
    assert KVTransferParams.from_json(params.to_json()) == params
    assert parse_kv_transfer_params({"do_remote_decode": True}) == RemoteDecodeRequest()
    with pytest.raises(RequestRejected, match="first_token_id"):
        parse_kv_transfer_params({**params.to_json(), "first_token_id": "5"})
    with pytest.raises(RequestRejected, match="unexpected keys"):
        parse_kv_transfer_params({"do_remote_decode": True, "x": 1})
    with pytest.raises(RequestRejected, match="object"):
        parse_kv_transfer_params([1])


def _request(rid: str, tokens: list[int], first: int = 7) -> Request:
    request = Request(rid, tokens, SamplingParams(max_tokens=8))
    request.output_token_ids.append(first)
    return request


def test_received_blocks_keep_hits_null_out_of_window_and_become_findable():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=[None, 6])
    tokens = list(range(100, 122))  # 22 tokens: 6 blocks; window 6 seen from 20: blocks 3, 4, 5
    a = _request("a", tokens)
    hit, num_hit = kv.get_computed_blocks(a)
    assert num_hit == 0
    tables, filled = kv.allocate_received(a, hit, num_hit, len(tokens))
    assert [(g, i) for g, i, _ in filled] == published_blocks([None, 6], 4, 22)
    assert tables[1][:3] == [kv.block_pool.null_block.block_id] * 3
    assert kv.num_used_blocks == 6 + 3
    # Not findable until the KV has arrived.
    b = _request("b", tokens)
    assert kv.get_computed_blocks(b)[1] == 0
    kv.cache_received(a, len(tokens))
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 20  # 5 full blocks (the 22nd token's block is partial)
    tables_b, filled_b = kv.allocate_received(b, hit, num_hit, len(tokens))
    assert [(g, i) for g, i, _ in filled_b] == [(0, 5), (1, 5)]  # only what the hit lacks
    assert tables_b[0][:5] == tables[0][:5] and tables_b[1][3:5] == tables[1][3:5]
    kv.free(a)
    kv.free(b)
    assert kv.num_used_blocks == 0


def test_received_allocation_refuses_without_room_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    request = _request("a", list(range(20)))  # 5 blocks
    assert kv.allocate_received(request, [], 0, 20) is None
    assert kv.num_used_blocks == 0 and kv.get_block_tables("a") == [[]]


class _FakeConnector(KVConnector):
    """Rows are bytes equal to their block index; ``gate`` holds a fetch until set."""

    name = "fake"

    def __init__(self) -> None:
        super().__init__(StagingArea(10, 1 << 20), TransferStats())
        self.gate = threading.Event()
        self.gate.set()
        self.fail: str | None = None
        self.released: list[str] = []

    def publish(self, manifest, fill):
        raise NotImplementedError

    def fetch(self, params, wanted, verify, write, cancelled, timeout_s):
        self.gate.wait(10)
        if self.fail:
            raise KVTransferError(self.fail)
        verify(Manifest(params.transfer_id, "L", 4, params.num_prompt_tokens, [], self.hashes))
        for pos, (_, i) in enumerate(wanted):
            if cancelled.is_set():
                raise KVTransferError("cancelled")
            write(pos, np.full((1, 4), i, dtype=np.uint8))
        return 4 * len(wanted)

    def release_remote(self, params, timeout_s):
        self.released.append(params.transfer_id)


def _consumer(num_blocks: int = 32):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    connector = _FakeConnector()
    written: dict[int, int] = {}

    def write(block_ids, rows):
        for b, row in zip(block_ids, rows):
            written[b] = int(row[0])

    consumer = KVConsumer(connector, kv, "L", 4, write, TransferStats(), load_timeout_s=5.0)
    return kv, connector, consumer, written


def _params(tokens, transfer_id="t1"):
    return KVTransferParams("fake", "x", transfer_id, 7, len(tokens), prompt_digest(tokens), "L")


def _poll_until(consumer, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        loaded, failed = consumer.poll()
        if loaded or failed or time.monotonic() > deadline:
            return loaded, failed
        consumer.wait(0.05)


def test_consumer_loads_into_the_allocated_blocks():
    kv, connector, consumer, written = _consumer()
    tokens = list(range(10))
    request = _request("a", tokens)
    connector.hashes = [h.hex() for h in kv.block_hashes(_request("x", tokens), 2)]
    consumer.add(request, _params(tokens))
    assert consumer.start_loads(max_new=4) == 1
    loaded, failed = _poll_until(consumer)
    assert loaded == [request] and not failed
    assert [written[b] for b in kv.get_block_ids("a")] == [0, 1, 2]
    assert consumer.stats.loaded == 1 and consumer.stats.received_blocks == 3
    kv.free(request)
    consumer.close()


def test_consumer_refuses_a_manifest_of_other_tokens():
    kv, connector, consumer, _ = _consumer()
    tokens = list(range(10))
    connector.hashes = ["00" * 32, "11" * 32]
    consumer.add(_request("a", tokens), _params(tokens))
    consumer.start_loads(4)
    loaded, failed = _poll_until(consumer)
    assert not loaded and "other tokens" in failed[0][1]
    assert kv.num_used_blocks == 0 and consumer.stats.failed == 1
    consumer.close()


def test_abort_during_a_load_frees_only_after_the_loader_lets_go():
    kv, connector, consumer, _ = _consumer()
    tokens = list(range(10))
    connector.hashes = [h.hex() for h in kv.block_hashes(_request("x", tokens), 2)]
    connector.gate.clear()
    consumer.add(_request("a", tokens), _params(tokens))
    consumer.start_loads(4)
    assert consumer.abort("a")
    assert consumer.poll() == ([], []) and kv.num_used_blocks == 3  # the loader still holds them
    connector.gate.set()
    deadline = time.monotonic() + 10
    while consumer.num_loading and time.monotonic() < deadline:
        consumer.wait(0.05)
        assert consumer.poll() == ([], [])
    assert kv.num_used_blocks == 0 and not consumer.has_pending
    consumer.close()


def test_queued_requests_wait_for_blocks_and_an_abort_releases_the_producer():
    kv, connector, consumer, _ = _consumer(num_blocks=4)
    tokens = list(range(12))  # 3 blocks each: the second does not fit beside the first
    connector.hashes = [h.hex() for h in kv.block_hashes(_request("x", tokens), 3)]
    connector.gate.clear()
    consumer.add(_request("a", tokens), _params(tokens, "t1"))
    consumer.add(_request("b", tokens + [1]), _params(tokens + [1], "t2"))
    assert consumer.start_loads(4) == 1 and consumer.num_queued == 1
    assert consumer.abort("b") and consumer.num_queued == 0
    deadline = time.monotonic() + 5
    while connector.released != ["t2"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert connector.released == ["t2"]
    connector.gate.set()
    loaded, _ = _poll_until(consumer)
    kv.free(loaded[0])
    consumer.close()


def test_instance_pool_picks_the_least_busy_healthy_and_fails_waiters_when_one_goes_down():
    pool = InstancePool(["http://p1", "http://p2/"], ["http://d1"], unhealthy_after=3)
    p1, p2 = pool.of_role("prefill")
    assert p2.url == "http://p2"
    p1.in_flight = 2
    assert pool.pick("prefill") is p2

    async def scenario():
        waiter = asyncio.get_running_loop().create_future()
        p2.waiters.add(waiter)
        assert not pool.check_failed(p2, "timeout", unreachable=False)
        assert not pool.check_failed(p2, "timeout", unreachable=False)
        assert pool.check_failed(p2, "timeout", unreachable=False)
        with pytest.raises(InstanceDown, match="p2 is down: timeout"):
            await waiter
    asyncio.run(scenario())
    assert pool.pick("prefill") is p1
    assert pool.check_failed(p1, "refused", unreachable=True)  # a dead process: at once
    assert pool.pick("prefill") is None
    pool.check_passed(p1)
    assert pool.pick("prefill") is p1


def test_launcher_passes_the_engine_flags_on_and_keeps_its_own():
    from kvserve.config import ConfigError
    from kvserve.disagg.launcher import DisaggregatedLauncher, instance_argv, parse_cpus

    argv = ["--model", "tiny-llama", "--disaggregate", "--prefill-cpus", "0", "--decode-cpus=1",
            "--port", "9000", "--host=0.0.0.0", "--kv-cache-dtype", "int8"]
    assert instance_argv(argv) == ["--model", "tiny-llama", "--kv-cache-dtype", "int8"]
    assert parse_cpus("0") == [0]
    with pytest.raises(ConfigError, match="not a CPU list"):
        parse_cpus("zero")
    with pytest.raises(ConfigError, match="not within"):
        parse_cpus("100000")
    with pytest.raises(ConfigError, match="overlap"):
        DisaggregatedLauncher(argv, [0], [0])
    launcher = DisaggregatedLauncher(argv, [0], [1])
    prefill, decode = launcher.children
    assert prefill.argv[prefill.argv.index("--cpus") + 1] == "0" and "--disaggregate" not in prefill.argv
    assert decode.argv[decode.argv.index("--disaggregation-mode") + 1] == "decode"
    assert launcher.router_config().prefill_urls == [prefill.url]
