"""Decode at the memory limit: the bytes a batch-1 decode token reads, counted from the loaded
model's layers in each weight format, the KV it reads, and the read bandwidth it is set against."""
from __future__ import annotations

import pytest
import torch

from kvserve.bench.decode_bytes import (KVReadSpec, lm_head_decode_bytes, linear_decode_bytes,
                                        mean_decode_context, summary_bandwidth_use)
from kvserve.bench.kvserve_driver import KvserveDriver
from kvserve.bench.machine import ModelFlops
from kvserve.bench.memory_bandwidth import measure_read_bandwidth
from kvserve.config import EngineArgs
from kvserve.kv_cache import KVCacheSpec
from kvserve.quant.bf16 import Bf16Linear
from kvserve.quant.lm_head import SCREEN_TOP_K, Q4Screen, RescoredLMHead
from kvserve.quant.q4 import Int4Linear
from kvserve.quant.registry import streamed_buffers
from kvserve.quant.segmented import SegmentedLinear

N, K = 64, 128


def _weight(n: int = N, k: int = K) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))


def test_bf16_layer_reads_two_bytes_a_weight():
    assert linear_decode_bytes(Bf16Linear(_weight(), None)) == 2 * N * K


def test_block_layer_reads_its_streamed_buffers_not_its_prefill_copy():
    layer = Int4Linear.from_float(_weight(), None)
    streamed = sum(getattr(layer, name).numel() * getattr(layer, name).element_size()
                   for name in streamed_buffers(layer) if getattr(layer, name) is not None)
    assert linear_decode_bytes(layer) == streamed
    assert N * K // 2 < streamed < N * K  # 4-bit codes and their group scales
    layer.add_prefill_copy("bf16")  # prompt rows only: a decode row never reads it
    assert linear_decode_bytes(layer) == streamed


def test_views_into_a_shared_arena_count_their_own_bytes():
    """Streamed buffers are moved into one huge-page arena: a view's storage is the arena's."""
    layer = Int4Linear.from_float(_weight(), None)
    alone = linear_decode_bytes(layer)
    name = next(n for n in streamed_buffers(layer) if getattr(layer, n) is not None)
    buffer = getattr(layer, name)
    arena = torch.zeros(buffer.numel() * 16, dtype=buffer.dtype)
    setattr(layer, name, arena[buffer.numel():2 * buffer.numel()].view(buffer.shape).copy_(buffer))
    assert linear_decode_bytes(layer) == alone


def test_segmented_layer_reads_each_segment():
    a, b = Int4Linear.from_float(_weight(32), None), Int4Linear.from_float(_weight(64), None)
    parts = linear_decode_bytes(a) + linear_decode_bytes(b)
    assert linear_decode_bytes(SegmentedLinear([a, b])) == parts


def test_lm_head_reads_the_screen_at_greedy_steps():
    vocab, hidden = 256, 128
    w = _weight(vocab, hidden)
    head = RescoredLMHead(Bf16Linear(w, None), w, screen=Q4Screen.from_float(w))
    screen = vocab // 16 * hidden // 64 * 576  # per tile of 16 rows and 64 inputs: 576 bytes
    row = hidden * 4  # an exact fp32 row of a rescored candidate
    assert lm_head_decode_bytes(head, greedy=True) == screen + SCREEN_TOP_K * row
    assert lm_head_decode_bytes(head, greedy=False) == 2 * vocab * hidden + head.top_k * row


@pytest.mark.parametrize("quantization, bytes_per_weight", [("bf16", 2.0), ("int4", 0.625)])
def test_model_weights_by_format(quantization, bytes_per_weight):
    """tiny-llama's decoder weights, against the architecture's parameter count: bf16 at 2
    bytes, int4 (Q4_1-like: 4 bits + an fp16 scale and minimum per 32) at 0.625."""
    driver = KvserveDriver(EngineArgs(model="tiny-llama", quantization=quantization, kv_cache_memory=16 * 2**20))
    counted = driver.decode_bytes
    params = ModelFlops.from_config(driver.engine.model_config).non_embedding_params
    assert sum(counted.linear_bytes_by_format.values()) == params * bytes_per_weight
    assert set(counted.linear_bytes_by_format) == {"bf16" if quantization == "bf16" else "q4"}
    assert counted.lm_head_bytes > 0 and counted.weight_bytes > params * bytes_per_weight
    run = driver.run(_single_stream(driver.vocab_size), progress=False)
    reported = run.extra["decode_bytes"]
    assert reported["mean_context_len"] == mean_decode_context([20], [5])
    assert reported["bytes_per_token"] == counted.per_token(reported["mean_context_len"])


def _single_stream(vocab: int):
    from kvserve.bench.workloads import WorkloadSpec, build_workload

    return build_workload(WorkloadSpec("t", "single", 1, (20, 20), 5), vocab)


def test_kv_read_counts_each_group_up_to_its_window():
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    kv = KVReadSpec.from_cache_spec(spec)
    assert kv.bytes_per_layer_token == 2 * 2 * 64 * 2 and kv.groups == ((4, None),)
    assert kv.bytes_at(100) == 4 * 100 * 512
    windowed = KVReadSpec(((15, 512), (3, None)), 768)
    assert windowed.bytes_at(1000) == 768 * (15 * 512 + 3 * 1000)
    assert windowed.bytes_at(100) == 768 * 18 * 100


def test_mean_decode_context():
    # The first token comes from the prompt's pass; the next ones attend to prompt + 1, + 2.
    assert mean_decode_context([10], [3]) == 11.5
    assert mean_decode_context([256], [256]) == 384.0
    assert mean_decode_context([4, 8], [1, 2]) == 9.0


def test_bandwidth_use_from_a_summary():
    summary = {"decode_bytes": {"bytes_per_token": 1e8, "weight_bytes": 9e7, "kv_bytes": 1e7},
               "tpot_ms": {"mean": 10.0}}
    use = summary_bandwidth_use(summary, 20.0)
    assert use["achieved_read_gbs"] == pytest.approx(10.0)
    assert use["fraction_of_read_bandwidth"] == pytest.approx(0.5)
    assert summary_bandwidth_use({"tpot_ms": {"mean": 10.0}}, 20.0) is None  # a peer: not counted
    assert summary_bandwidth_use(summary, None) is None


def test_read_bandwidth_measurement():
    bw = measure_read_bandwidth(buffer_bytes=8 * 2**20, repeats=2)
    assert bw.buffer_bytes == 8 * 2**20 and bw.repeats == 2 and bw.gbs > 0.05
    assert bw.to_dict()["gbs"] == bw.gbs
