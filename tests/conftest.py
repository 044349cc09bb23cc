"""Shared fixtures. Every engine built through ``engine_factory`` is checked after each test:
zero KV blocks in use, zero running or waiting requests (nothing leaks, nothing hangs)."""
from __future__ import annotations

import gc
import os
import weakref
from collections import OrderedDict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest

_live_engines: "weakref.WeakSet" = weakref.WeakSet()
_MAX_CACHED_ENGINES = 6


def track_engine(engine) -> None:
    _live_engines.add(engine)


@pytest.fixture(scope="session")
def llm_factory():
    """Build (and cache per argument set) an LLM; engines are shared across tests."""
    from kvserve.llm import LLM

    cache: "OrderedDict[tuple, LLM]" = OrderedDict()

    def make(**kwargs) -> LLM:
        # Cached engines stay alive: keep each one's KV cache small (the default budget is up
        # to 1 GiB, zero-filled, so resident).
        if "num_blocks" not in kwargs:
            kwargs.setdefault("kv_cache_memory", 64 << 20)
        key = tuple(sorted(kwargs.items()))
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        # Least recently used engines go: the whole suite builds dozens (an fp32 Gemma holds
        # ~1 GB) and keeping them all ran a 24 GiB machine out of memory. A test still holding
        # an evicted one keeps it alive until it ends.
        if len(cache) >= _MAX_CACHED_ENGINES:
            while len(cache) >= _MAX_CACHED_ENGINES:
                cache.popitem(last=False)
            gc.collect()
        llm = LLM(**kwargs)
        track_engine(llm.engine)
        cache[key] = llm
        return llm

    return make


@pytest.fixture(autouse=True)
def _engines_left_idle():
    yield
    for engine in list(_live_engines):
        assert not engine.scheduler.has_unfinished_requests(), "requests left in the scheduler"
        assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
        assert engine.kv_manager.num_used_blocks == 0, (
            f"{engine.kv_manager.num_used_blocks} KV blocks still in use after the test")
        assert engine.output_processor.num_unfinished == 0


@pytest.fixture(autouse=True)
def _default_kernels_after():
    """A test whose engine ran with other kernel settings (plain torch, no batch invariance, no
    step teams) leaves the defaults in force for the next test, which may call kernels directly
    (an engine puts its own settings back before each of its steps)."""
    yield
    from kvserve import ops
    from kvserve.config import KernelConfig

    applied = ops.applied_kernel_config()
    if applied is not None and not (applied.native_kernels and applied.batch_invariant and applied.step_teams):
        ops.apply_kernel_config(KernelConfig())


def pytest_addoption(parser):
    parser.addoption("--tp-full", action="store_true",
                     help="also run the long tensor-parallel cases (more ranks, the real models, two local nodes)")


def pytest_configure(config):
    config.addinivalue_line("markers", "tp_full: a long tensor-parallel case, run with --tp-full")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--tp-full"):
        return
    skip = pytest.mark.skip(reason="a long tensor-parallel case: run with --tp-full")
    for item in items:
        if "tp_full" in item.keywords:
            item.add_marker(skip)
