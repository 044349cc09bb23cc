"""The KV pool's budget: explicit, default, and ``auto`` (what is free after weights, mapped
file and one step's workspace)."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.cli import build_parser
from kvserve.config import CacheConfig, ConfigError
from kvserve.kv_budget import (AUTO_HEADROOM_BYTES, AUTO_UTILIZATION, auto_kv_cache_memory,
                               host_available_bytes, parse_kv_cache_memory, step_workspace_bytes)


@pytest.mark.parametrize("value", [None, "auto", 1, 256 << 20, np.int64(1 << 20)])
def test_parse_accepts_nothing_auto_and_positive_counts(value):
    assert parse_kv_cache_memory(value) == value


@pytest.mark.parametrize("value", [0, -5, "lots", 1.5, True])
def test_parse_refuses_anything_else_with_a_config_error(value):
    with pytest.raises(ValueError):
        parse_kv_cache_memory(value)
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        CacheConfig(kv_cache_memory=value).validate()


def test_auto_takes_its_share_of_what_is_left_after_mapped_weights_and_workspace():
    gib = 1 << 30
    budget = auto_kv_cache_memory(mapped_bytes=5 * gib, workspace_bytes=gib // 2, available=20 * gib)
    assert budget.bytes == int((20 * gib - 5 * gib - gib // 2 - AUTO_HEADROOM_BYTES) * AUTO_UTILIZATION)
    assert budget.rule == "auto" and "5120 MiB mapped weights" in budget.describe()
    # Nothing left: an empty budget (the engine then refuses with its "too small" error).
    assert auto_kv_cache_memory(8 * gib, 0, available=4 * gib).bytes == 0
    # Ranks on one host: each pool a share of the spare memory, a workspace each.
    shared = auto_kv_cache_memory(mapped_bytes=5 * gib, workspace_bytes=gib // 2, available=20 * gib, num_pools=2)
    assert shared.bytes == int((20 * gib - 5 * gib - gib - AUTO_HEADROOM_BYTES) * AUTO_UTILIZATION) // 2
    assert "shared by 2 ranks" in shared.describe()


def test_cgroup_usage_does_not_count_reclaimable_file_pages(tmp_path, monkeypatch):
    from kvserve import kv_budget
    (tmp_path / "memory.max").write_text(str(8 << 30))
    (tmp_path / "memory.current").write_text(str(7 << 30))
    (tmp_path / "memory.stat").write_text(f"anon {2 << 30}\ninactive_file {5 << 30}\nactive_file 0\n")
    monkeypatch.setattr(kv_budget, "Path", lambda *parts: tmp_path.joinpath(*parts[1:]))
    assert kv_budget._cgroup_free_bytes() == 6 << 30


def test_host_available_memory_is_read():
    assert host_available_bytes() > 0


def test_workspace_grows_with_the_step_and_the_model():
    small = step_workspace_bytes(576, 1536, 576, 384, 49152, 2048, 64)
    assert small == 4 * (2048 * (3 * 576 + 576 + 384 + 3 * 1536) + 2 * 64 * 49152)
    assert step_workspace_bytes(2048, 8192, 2048, 1024, 128256, 2048, 64) > 4 * small


def test_cli_reads_auto_and_byte_counts():
    parser = build_parser()
    assert parser.parse_args(["generate", "--kv-cache-memory", "auto", "hi"]).kv_cache_memory == "auto"
    assert parser.parse_args(["generate", "--kv-cache-memory", "64M", "hi"]).kv_cache_memory == 64 << 20


def test_engine_sizes_an_auto_pool_from_free_memory_and_says_so():
    from kvserve.engine import LLMEngine

    engine = LLMEngine(model="tiny-llama", kv_cache_memory="auto", max_num_seqs=4)
    # Free memory dwarfs tiny-llama's contexts: the pool is capped at max_num_seqs full contexts.
    assert engine.num_blocks == 4 * engine.max_request_blocks + 1
    text = engine.describe_memory()
    assert "auto:" in text and "step workspace" in text
    explicit = LLMEngine(model="tiny-llama", kv_cache_memory=1 << 20)
    assert "(explicit)" in explicit.describe_memory()


def test_disaggregate_refuses_auto_with_a_reason():
    from kvserve.disagg.launcher import DisaggregatedLauncher

    with pytest.raises(ConfigError, match="two instances"):
        DisaggregatedLauncher(["--model", "tiny-llama", "--kv-cache-memory", "auto"], [0], [1])
