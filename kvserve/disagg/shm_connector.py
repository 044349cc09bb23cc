"""One host: each transfer is a file in /dev/shm (memory, not disk) that the prefill instance
writes once and the decode instance maps and reads the rows it lacks from, then unlinks.

No socket, no server: a prefill instance that dies after publishing leaves its files behind,
still readable, so its decode side loses nothing; one whose decode side never comes has its
files removed at expiry (``sweep``) or shutdown. File layout: 8 bytes of magic, the manifest's
JSON length (8 bytes, little endian), the manifest, padding to 64 bytes, then the rows.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import threading
from typing import Callable

import numpy as np

from kvserve.disagg.connector import KVConnector, Manifest, WriteRows
from kvserve.disagg.params import KVTransferParams
from kvserve.disagg.plan import BlockRef, KVTransferError, row_runs, rows_of
from kvserve.disagg.staging import StagedTransfer, StagingArea
from kvserve.disagg.stats import TransferStats

MAGIC = b"KVSVKV01"
FILE_PREFIX = "kvserve-kv-"
# Only files of this shape are opened (and unlinked) on a request's word: the address comes
# in a request body, and must not name any other file.
_NAME = re.compile(r"^kvserve-kv-[0-9a-f]{8,32}-[0-9a-f]{8,32}$")


def _payload_offset(header_len: int) -> int:
    return -(-(16 + header_len) // 64) * 64


class SharedMemoryConnector(KVConnector):
    name = "shm"

    def __init__(self, staging: StagingArea, stats: TransferStats, shm_dir: str = "/dev/shm") -> None:
        super().__init__(staging, stats)
        self.shm_dir = os.path.realpath(shm_dir)
        if not os.path.isdir(self.shm_dir):
            raise KVTransferError(f"shared-memory directory {shm_dir} does not exist")
        self.instance_token = secrets.token_hex(6)  # names this producer's files

    # ---- producer side ------------------------------------------------------------------

    def publish(self, manifest: Manifest, fill: Callable[[np.ndarray], None]) -> str:
        header = json.dumps(manifest.to_json()).encode()
        offset = _payload_offset(len(header))
        rows, bpb = len(manifest.published), manifest.bytes_per_block
        path = os.path.join(self.shm_dir, f"{FILE_PREFIX}{self.instance_token}-{manifest.transfer_id}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, offset + rows * bpb)
            with mmap.mmap(fd, offset + rows * bpb) as mm:
                mm[:8] = MAGIC
                mm[8:16] = len(header).to_bytes(8, "little")
                mm[16:16 + len(header)] = header
                if rows:
                    view = np.frombuffer(mm, dtype=np.uint8, count=rows * bpb, offset=offset)
                    fill(view.reshape(rows, bpb))
                    del view  # the map cannot close while a view exports it
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        self.staging.add(StagedTransfer(manifest.transfer_id, rows * bpb, release=lambda: _unlink(path),
                                        consumed=lambda: not os.path.exists(path)))
        return path

    # ---- consumer side ------------------------------------------------------------------

    def _checked_path(self, address: str) -> str:
        path = os.path.realpath(address)
        if os.path.dirname(path) != self.shm_dir or not _NAME.match(os.path.basename(path)):
            raise KVTransferError(f"{address!r} is not a kvserve shared-memory transfer in {self.shm_dir}")
        return path

    def fetch(self, params: KVTransferParams, wanted: list[BlockRef], verify: Callable[[Manifest], None],
              write: WriteRows, cancelled: threading.Event, timeout_s: float) -> int:
        path = self._checked_path(params.address)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise KVTransferError(f"transfer {params.transfer_id} is gone (expired, or its prefill "
                                  f"instance shut down)") from None
        try:
            size = os.fstat(fd).st_size
            if size < 16:
                raise KVTransferError(f"transfer file {path} is truncated")
            # A private mapping: numpy and torch get a writable buffer, and nothing is copied
            # unless written (nothing is).
            with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mm:
                if mm[:8] != MAGIC:
                    raise KVTransferError(f"{path} is not a kvserve transfer file")
                header_len = int.from_bytes(mm[8:16], "little")
                if 16 + header_len > size:
                    raise KVTransferError(f"transfer file {path} is truncated")
                try:
                    manifest = Manifest.from_json(json.loads(mm[16:16 + header_len]))
                except ValueError as exc:
                    raise KVTransferError(f"transfer file {path} has a malformed manifest ({exc})") from None
                verify(manifest)
                offset, bpb = _payload_offset(header_len), manifest.bytes_per_block
                if offset + len(manifest.published) * bpb > size:
                    raise KVTransferError(f"transfer file {path} is truncated")
                payload = np.frombuffer(mm, dtype=np.uint8, count=len(manifest.published) * bpb,
                                        offset=offset).reshape(-1, bpb) if manifest.published else None
                position = 0
                for first_row, count in row_runs(rows_of(manifest.published, wanted)):
                    if cancelled.is_set():
                        raise KVTransferError("cancelled")
                    write(position, payload[first_row:first_row + count])
                    position += count
                del payload
        finally:
            os.close(fd)
            _unlink(path)  # read once: the producer sees it gone and drops its record
        return len(wanted) * manifest.bytes_per_block

    def release_remote(self, params: KVTransferParams, timeout_s: float) -> None:
        try:
            _unlink(self._checked_path(params.address))
        except KVTransferError:
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
