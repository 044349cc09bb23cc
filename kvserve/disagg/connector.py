"""The KV connector interface: how a request's finished KV blocks leave a prefill instance and
reach a decode instance. vLLM's KVConnectorBase_V1 in miniature, for kvserve's shape (the
model runs in the engine's process, so scheduler side and worker side are one object):

- producer side (prefill instance): ``publish`` stages the blocks under a transfer id and
  returns the address a decode side fetches them from; ``release`` drops a transfer whose
  decode side will not come; ``sweep`` expires the ones nobody fetched.
- consumer side (decode instance): ``fetch`` reads the entries it lacks, checks the manifest
  (layout, block hashes) through ``verify`` before a byte lands, and hands the rows to
  ``write`` as they arrive; ``release_remote`` tells the producer a transfer is not needed.

Pull, not push: the decode side knows which blocks its prefix cache already holds, so only
the missing ones move. Two implementations: ``SharedMemoryConnector`` (one host, a file in
/dev/shm per transfer) and ``TCPConnector`` (two hosts, the producer serves its staging area
on a socket). Both stage a copy of the blocks, so the prefill instance frees its pool blocks
at the moment the request finishes, whatever the decode side does.
"""
from __future__ import annotations

import abc
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from kvserve.disagg.params import KVTransferParams
from kvserve.disagg.plan import BlockRef, KVTransferError
from kvserve.disagg.staging import StagingArea
from kvserve.disagg.stats import TransferStats

# write(first position in the wanted list, rows [k, bytes_per_block] uint8): the rows of
# wanted[first:first + k], valid only during the call.
WriteRows = Callable[[int, np.ndarray], None]


@dataclass
class Manifest:
    """What a staged payload holds: row r is ``published[r]``'s block in every layer slot,
    ``bytes_per_block`` bytes laid out as ``kv_layout`` says (block_io.layout_id)."""

    transfer_id: str
    kv_layout: str
    bytes_per_block: int
    num_prompt_tokens: int
    published: list[BlockRef] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)  # the full prompt blocks', hex

    def to_json(self) -> dict:
        out = asdict(self)
        out["published"] = [list(e) for e in self.published]
        return out

    @classmethod
    def from_json(cls, value: dict) -> "Manifest":
        try:
            return cls(transfer_id=str(value["transfer_id"]), kv_layout=str(value["kv_layout"]),
                       bytes_per_block=int(value["bytes_per_block"]),
                       num_prompt_tokens=int(value["num_prompt_tokens"]),
                       published=[(int(g), int(i)) for g, i in value["published"]],
                       block_hashes=[str(h) for h in value["block_hashes"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise KVTransferError(f"malformed transfer manifest ({exc})") from None


class KVConnector(abc.ABC):
    name: str

    def __init__(self, staging: StagingArea, stats: TransferStats) -> None:
        self.staging = staging
        self.stats = stats

    # ---- producer side ------------------------------------------------------------------

    @abc.abstractmethod
    def publish(self, manifest: Manifest, fill: Callable[[np.ndarray], None]) -> str:
        """Stage ``len(manifest.published)`` rows under ``manifest.transfer_id``: ``fill(rows)``
        writes them into the staging buffer ([rows, bytes_per_block] uint8). Returns the
        address a decode side fetches from."""

    def release(self, transfer_id: str) -> bool:
        """Drop a staged transfer (its decode side will not come); False if unknown."""
        return self.staging.discard(transfer_id)

    def sweep(self) -> None:
        consumed, expired = self.staging.sweep()
        for _ in range(consumed):
            self.stats.on_fetched(0)
        if expired:
            self.stats.on_expired(expired)

    # ---- consumer side ------------------------------------------------------------------

    @abc.abstractmethod
    def fetch(self, params: KVTransferParams, wanted: list[BlockRef], verify: Callable[[Manifest], None],
              write: WriteRows, cancelled: threading.Event, timeout_s: float) -> int:
        """Read the ``wanted`` entries of a published transfer into ``write``; returns the bytes
        read. Raises KVTransferError (producer gone or silent past ``timeout_s``, transfer
        expired, ``verify`` refused the manifest, ``cancelled`` set). The transfer is released
        on the producer side however it ends."""

    @abc.abstractmethod
    def release_remote(self, params: KVTransferParams, timeout_s: float) -> None:
        """Tell the producer its transfer is not needed (best effort: it expires anyway)."""

    def close(self) -> None:
        self.staging.clear()
