"""The decode instance's side: requests whose prompt KV comes from a prefill instance.

Torch-free (the copy into the cache is the injected ``write_blocks``). A request passes
through three states here before the scheduler runs it:

- queued: waiting for blocks (and for a sequence slot, which the engine grants);
- loading: its prefix-cache hit is kept and the blocks past it are allocated
  (``KVCacheManager.allocate_received``); a loader thread fetches only those from the
  producer and writes them into the cache while the engine keeps stepping the others;
- done: the blocks are registered in the prefix cache and the request joins the running
  batch at its first token, or, when the transfer failed, it is handed back to be
  re-prefilled locally (its prompt and first token are known, so the answer is the same).

An abort never frees the blocks of a transfer in flight (the loader may still write into
them): it cancels the transfer and the blocks are freed when the loader has let go.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from kvserve.disagg.connector import KVConnector, Manifest
from kvserve.disagg.params import KVTransferParams
from kvserve.disagg.plan import BlockRef, KVTransferError
from kvserve.disagg.stats import TransferStats
from kvserve.kv_manager import KVCacheManager
from kvserve.request import Request

logger = logging.getLogger("kvserve")


@dataclass
class _Pending:
    request: Request
    params: KVTransferParams
    wanted: list[BlockRef] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_reused: int = 0
    future: Optional[concurrent.futures.Future] = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False
    started: float = 0.0


class KVConsumer:
    def __init__(self, connector: KVConnector, kv_manager: KVCacheManager, kv_layout: str, bytes_per_block: int,
                 write_blocks: Callable[[Sequence[int], np.ndarray], None], stats: TransferStats,
                 load_timeout_s: float = 10.0, max_concurrent_loads: int = 4) -> None:
        self.connector = connector
        self.kv_manager = kv_manager
        self.kv_layout = kv_layout
        self.bytes_per_block = bytes_per_block
        self.write_blocks = write_blocks
        self.stats = stats
        self.load_timeout_s = load_timeout_s
        self.max_concurrent_loads = max_concurrent_loads
        self._queued: deque[_Pending] = deque()
        self._loading: dict[str, _Pending] = {}
        # Loads and best-effort releases (network I/O) run here, never on the engine thread.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrent_loads + 1,
                                                           thread_name_prefix="kvserve-kv-load")

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_loading(self) -> int:
        """Transfers in flight, aborted ones included (they still hold their blocks)."""
        return len(self._loading)

    @property
    def has_pending(self) -> bool:
        return bool(self._queued or self._loading)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._loading or any(p.request.request_id == request_id for p in self._queued)

    # ---- engine thread -------------------------------------------------------------------

    def add(self, request: Request, params: KVTransferParams) -> None:
        self._queued.append(_Pending(request, params))

    def start_loads(self, max_new: int) -> int:
        """Give queued requests their blocks and start their transfers, in arrival order, up to
        ``max_new`` of them and while the pool has room; returns how many started."""
        started = 0
        while self._queued and started < max_new and len(self._loading) < self.max_concurrent_loads:
            pending = self._queued[0]
            request, params = pending.request, pending.params
            num_prompt = params.num_prompt_tokens
            hit_ids, num_hit = self.kv_manager.get_computed_blocks(request)
            allocated = self.kv_manager.allocate_received(request, hit_ids, num_hit, num_prompt)
            if allocated is None:
                break  # blocks free up as running requests finish
            self._queued.popleft()
            _, filled = allocated
            pending.wanted = [(g, i) for g, i, _ in filled]
            pending.block_ids = [b for _, _, b in filled]
            pending.num_reused = num_hit // self.kv_manager.block_size
            pending.started = time.perf_counter()
            hashes = [h.hex() for h in self.kv_manager.block_hashes(request, num_prompt // self.kv_manager.block_size)]
            self._loading[request.request_id] = pending
            pending.future = self._pool.submit(self._load, pending, hashes)
            started += 1
        return started

    def poll(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Finished transfers: (requests whose KV is in place and findable, (request, reason)
        for each that failed; its blocks are freed). Aborted ones are freed and dropped."""
        loaded: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for rid, pending in list(self._loading.items()):
            if not pending.future.done():
                continue
            del self._loading[rid]
            request = pending.request
            error = pending.future.exception()
            if pending.aborted:
                self.kv_manager.free(request)
                continue
            if error is not None:
                self.kv_manager.free(request)
                self.stats.on_failed()
                failed.append((request, str(error)))
                continue
            self.kv_manager.cache_received(request, pending.params.num_prompt_tokens)
            self.stats.on_loaded(pending.future.result(), len(pending.wanted), pending.num_reused,
                                 time.perf_counter() - pending.started)
            loaded.append(request)
        return loaded, failed

    def wait(self, timeout_s: float) -> None:
        """Block until a transfer finishes or ``timeout_s`` passes (the engine has nothing
        else to do)."""
        futures = [p.future for p in self._loading.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def abort(self, request_id: str) -> bool:
        """Abort a request held here; False if it is not. A queued one is dropped (and its
        producer told); a loading one is cancelled and freed once its loader lets go."""
        pending = self._loading.get(request_id)
        if pending is not None:
            pending.aborted = True
            pending.cancelled.set()
            return True
        for pending in self._queued:
            if pending.request.request_id == request_id:
                self._queued.remove(pending)
                self.release_remote(pending.params)
                return True
        return False

    def release_remote(self, params: KVTransferParams) -> None:
        """Tell the producer a transfer will not be fetched (in the background)."""
        if params.transfer_id is not None:
            self._pool.submit(self.connector.release_remote, params, self.load_timeout_s)

    def close(self) -> None:
        for pending in list(self._loading.values()):
            pending.cancelled.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.connector.close()

    # ---- loader threads ------------------------------------------------------------------

    def _load(self, pending: _Pending, own_hashes: list[str]) -> int:
        params = pending.params
        if params.transfer_id is None:
            raise KVTransferError("the prefill instance published no KV for this request")
        if not pending.wanted:
            self.connector.release_remote(params, self.load_timeout_s)
            return 0

        def verify(manifest: Manifest) -> None:
            if manifest.kv_layout != self.kv_layout or manifest.bytes_per_block != self.bytes_per_block:
                raise KVTransferError(f"the transfer's KV layout {manifest.kv_layout} is not this "
                                      f"instance's {self.kv_layout}")
            if manifest.num_prompt_tokens != params.num_prompt_tokens or manifest.block_hashes != own_hashes:
                raise KVTransferError("the transfer's blocks hold other tokens than this request's prompt")

        ids = pending.block_ids

        def write(position: int, rows: np.ndarray) -> None:
            self.write_blocks(ids[position:position + len(rows)], rows)

        return self.connector.fetch(params, pending.wanted, verify, write, pending.cancelled, self.load_timeout_s)
