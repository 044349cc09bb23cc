"""Two hosts: the prefill instance keeps its staged transfers in memory and serves them on a
TCP port; a decode instance connects, names the transfer and the entries it lacks, and reads
the manifest and then those rows.

Messages are a 4-byte little-endian length and a JSON object. Requests: ``{"op": "fetch",
"transfer_id", "blocks": [[group, index], ...]}`` (answered by ``{"ok": true, "manifest"}``
and the rows, in the order asked, or ``{"ok": false, "error"}``) and ``{"op": "release",
"transfer_id"}``. A fetch takes the transfer out of staging: each is read once. Every socket
operation of the decode side is bounded by its timeout, so a prefill instance that dies or
hangs mid-transfer fails the transfer instead of stalling it.
"""
from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
from typing import Callable, Optional

import numpy as np

from kvserve.disagg.connector import KVConnector, Manifest, WriteRows
from kvserve.disagg.params import KVTransferParams
from kvserve.disagg.plan import BlockRef, KVTransferError, row_runs, rows_of
from kvserve.disagg.staging import StagedTransfer, StagingArea
from kvserve.disagg.stats import TransferStats

logger = logging.getLogger("kvserve")

MAX_MESSAGE = 64 << 20  # a request or a manifest: JSON, far below this
READ_CHUNK_BYTES = 8 << 20  # rows handed to ``write`` at a time (a bounded receive buffer)


def send_message(sock: socket.socket, value: dict) -> None:
    data = json.dumps(value).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv_exact(sock: socket.socket, n: int, into: Optional[memoryview] = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:n])
        if k == 0:
            raise KVTransferError("the prefill instance closed the connection mid-transfer")
        got += k
    return buf


def recv_message(sock: socket.socket) -> dict:
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    if n > MAX_MESSAGE:
        raise KVTransferError(f"message of {n} bytes refused")
    try:
        value = json.loads(bytes(recv_exact(sock, n)))
    except ValueError as exc:
        raise KVTransferError(f"malformed message ({exc})") from None
    if not isinstance(value, dict):
        raise KVTransferError("malformed message (not an object)")
    return value


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise KVTransferError(f"{address!r} is not a host:port address")
    return host.strip("[]"), int(port)


class TCPConnector(KVConnector):
    name = "tcp"

    def __init__(self, staging: StagingArea, stats: TransferStats, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: Optional[str] = None, serve: bool = True) -> None:
        super().__init__(staging, stats)
        self._server: Optional[socketserver.ThreadingTCPServer] = None
        self.address = ""
        if serve:
            self._server = _KVServer((host, port), _Handler, self)
            bound_port = self._server.server_address[1]
            self.address = f"{advertise_host or host}:{bound_port}"
            threading.Thread(target=self._server.serve_forever, name="kvserve-kv-server", daemon=True).start()
            logger.info("KV transfers served on %s", self.address)

    # ---- producer side ------------------------------------------------------------------

    def publish(self, manifest: Manifest, fill: Callable[[np.ndarray], None]) -> str:
        if self._server is None:
            raise KVTransferError("this TCP connector does not serve transfers (a decode instance's)")
        rows = np.empty((len(manifest.published), manifest.bytes_per_block), dtype=np.uint8)
        if len(rows):
            fill(rows)
        self.staging.add(StagedTransfer(manifest.transfer_id, rows.nbytes, release=lambda: None,
                                        payload=rows, manifest=manifest))
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        super().close()

    # ---- consumer side ------------------------------------------------------------------

    def fetch(self, params: KVTransferParams, wanted: list[BlockRef], verify: Callable[[Manifest], None],
              write: WriteRows, cancelled: threading.Event, timeout_s: float) -> int:
        host, port = parse_address(params.address)
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                send_message(sock, {"op": "fetch", "transfer_id": params.transfer_id,
                                    "blocks": [list(e) for e in wanted]})
                answer = recv_message(sock)
                if not answer.get("ok"):
                    raise KVTransferError(f"the prefill instance at {params.address} refused: "
                                          f"{answer.get('error', 'no reason given')}")
                manifest = Manifest.from_json(answer.get("manifest") or {})
                verify(manifest)
                bpb = manifest.bytes_per_block
                chunk_rows = max(1, READ_CHUNK_BYTES // max(1, bpb))
                buffer = np.empty((min(chunk_rows, max(1, len(wanted))), bpb), dtype=np.uint8)
                flat = memoryview(buffer.reshape(-1))
                position = 0
                while position < len(wanted):
                    if cancelled.is_set():
                        raise KVTransferError("cancelled")
                    k = min(chunk_rows, len(wanted) - position)
                    recv_exact(sock, k * bpb, flat)
                    write(position, buffer[:k])
                    position += k
                return len(wanted) * bpb
        except socket.timeout:
            raise KVTransferError(f"the prefill instance at {params.address} sent nothing for "
                                  f"{timeout_s:.0f} s") from None
        except OSError as exc:
            raise KVTransferError(f"the prefill instance at {params.address} is unreachable ({exc})") from None

    def release_remote(self, params: KVTransferParams, timeout_s: float) -> None:
        if params.transfer_id is None:
            return
        try:
            host, port = parse_address(params.address)
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                send_message(sock, {"op": "release", "transfer_id": params.transfer_id})
                recv_message(sock)
        except (OSError, KVTransferError) as exc:  # it expires on the producer anyway
            logger.debug("release of transfer %s failed: %s", params.transfer_id, exc)


class _KVServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, connector: TCPConnector) -> None:
        self.connector = connector
        super().__init__(address, handler)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        connector: TCPConnector = self.server.connector
        sock: socket.socket = self.request
        sock.settimeout(60.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            message = recv_message(sock)
            op, transfer_id = message.get("op"), message.get("transfer_id")
            if op == "release":
                connector.release(str(transfer_id))
                send_message(sock, {"ok": True})
                return
            if op != "fetch":
                send_message(sock, {"ok": False, "error": f"unknown op {op!r}"})
                return
            entry = connector.staging.take(str(transfer_id))
            if entry is None:
                send_message(sock, {"ok": False, "error": f"no transfer {transfer_id} (expired or already fetched)"})
                return
            try:
                manifest: Manifest = entry.manifest
                wanted = [(int(g), int(i)) for g, i in message.get("blocks", [])]
                rows = rows_of(manifest.published, wanted)
                send_message(sock, {"ok": True, "manifest": manifest.to_json()})
                payload = memoryview(entry.payload.reshape(-1)) if len(entry.payload) else None
                bpb = manifest.bytes_per_block
                for first, count in row_runs(rows):
                    sock.sendall(payload[first * bpb:(first + count) * bpb])
                connector.stats.on_fetched(len(rows) * bpb)
            finally:
                entry.release()
        except (KVTransferError, ValueError, TypeError) as exc:
            try:
                send_message(sock, {"ok": False, "error": str(exc)})
            except OSError:
                pass
        except OSError as exc:  # the decode side went away mid-transfer (cancelled)
            logger.debug("KV transfer connection ended: %s", exc)
