"""The prefill instance's side: when a request marked ``do_remote_decode`` has its first
token, its KV blocks are published through the connector (copied out of the pool, so the
pool's blocks are freed as for any finished request) and the output carries the
``KVTransferParams`` its decode instance continues from."""
from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from kvserve.disagg.connector import KVConnector, Manifest
from kvserve.disagg.params import FirstTokenLogprob, KVTransferParams, prompt_digest
from kvserve.disagg.plan import KVTransferError, published_blocks
from kvserve.disagg.stats import TransferStats
from kvserve.kv_manager import KVCacheManager
from kvserve.request import Request

logger = logging.getLogger("kvserve")

SWEEP_INTERVAL_S = 1.0


class KVProducer:
    """``gather(block_ids, rows)`` copies blocks out of this engine's cache (block_io)."""

    def __init__(self, connector: KVConnector, kv_manager: KVCacheManager, kv_layout: str, bytes_per_block: int,
                 gather: Callable[[Sequence[int], np.ndarray], None], stats: TransferStats) -> None:
        self.connector = connector
        self.kv_manager = kv_manager
        self.kv_layout = kv_layout
        self.bytes_per_block = bytes_per_block
        self.gather = gather
        self.stats = stats
        self._stop = threading.Event()
        # Expiry must not wait for the next publish: an idle prefill instance still frees what
        # nobody fetched, and notices what a shared-memory consumer took.
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvserve-kv-sweeper", daemon=True)
        self._sweeper.start()

    def params_for(self, request: Request, block_tables: Optional[list[list[int]]],
                   first_token_logprobs: Optional[list[FirstTokenLogprob]] = None) -> KVTransferParams:
        """Publish ``request``'s prompt KV (its blocks ``block_tables``, about to be freed) and
        name it; with ``block_tables`` None nothing is published (the first token finished
        the request: the decode side only reports it)."""
        num_prompt = request.num_prompt_tokens
        params = KVTransferParams(connector=self.connector.name, address="", transfer_id=None,
                                  first_token_id=request.output_token_ids[0], num_prompt_tokens=num_prompt,
                                  prompt_digest=prompt_digest(request.prompt_token_ids), kv_layout=self.kv_layout,
                                  first_token_logprobs=first_token_logprobs)
        if block_tables is None:
            return params
        t0 = time.perf_counter()
        block_size = self.kv_manager.block_size
        published = published_blocks(self.kv_manager.group_windows, block_size, num_prompt)
        block_ids = [block_tables[g][i] for g, i in published]
        null = self.kv_manager.block_pool.null_block
        if null is not None and null.block_id in block_ids:
            # A sliding group already gave back a block before the last full-block boundary (a
            # last chunk that started inside the final block): publish nothing rather than a
            # zero block, and the decode side recomputes the prompt.
            raise KVTransferError("a sliding-window block of the prompt was already released")
        manifest = Manifest(transfer_id=secrets.token_hex(8), kv_layout=self.kv_layout,
                            bytes_per_block=self.bytes_per_block, num_prompt_tokens=num_prompt,
                            published=published,
                            block_hashes=[h.hex() for h in self.kv_manager.block_hashes(request, num_prompt // block_size)])
        params.address = self.connector.publish(manifest, lambda rows: self.gather(block_ids, rows))
        params.transfer_id = manifest.transfer_id
        params.staged_blocks = published
        self.stats.on_published(len(published) * self.bytes_per_block, time.perf_counter() - t0)
        return params

    def release(self, transfer_id: str) -> bool:
        return self.connector.release(transfer_id)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            try:
                self.connector.sweep()
            except Exception:  # a sweep must never end the loop
                logger.exception("KV staging sweep failed")

    def close(self) -> None:
        self._stop.set()
        self.connector.close()
