"""A peer in its own process: one that crashes (llama.cpp's native AMX path dies with SIGILL
on some machines) or leaks threads and memory takes only itself down.

The child builds the peer with ``open_peer`` and answers ``warmup`` / ``run`` / ``close``
over a pipe; the parent's ``IsolatedPeer`` has the peer interface the bench drives. A child
that dies mid-call surfaces as ``PeerCrashed`` naming its exit code or signal, which the
round robin reports as a skipped peer while the other engines go on.
"""
from __future__ import annotations

import multiprocessing
import signal
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from kvserve.bench.peers import PeerContext, PeerUnavailable
from kvserve.bench.timing import EngineRun
from kvserve.bench.workloads import Workload

# A peer loads its model in the child: minutes at most, even for HF fp32 Gemma.
_OPEN_TIMEOUT_S = 900.0


class PeerCrashed(RuntimeError):
    """The peer's process died (or stopped answering) during a call."""


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _child_main(conn: Connection, name: str, ctx: PeerContext, opener: Optional[Callable]) -> None:
    import torch

    from kvserve.bench.peers import open_peer

    torch.set_num_threads(ctx.num_threads)
    try:
        peer = (opener or open_peer)(name, ctx)
    except PeerUnavailable as exc:
        conn.send(("unavailable", str(exc)))
        return
    except Exception as exc:  # reported to the parent, which skips this peer
        conn.send(("error", repr(exc)))
        return
    conn.send(("ok", peer.name))
    while True:
        try:
            command, args = conn.recv()
        except EOFError:  # the parent went away
            break
        if command == "close":
            peer.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(peer, command)(*args)))
        except Exception as exc:
            conn.send(("error", repr(exc)))


class IsolatedPeer:
    """``open_peer(name, ctx)`` run in a spawned process, driven through a pipe. ``opener``
    replaces ``open_peer`` (a module-level function: the child imports it by name)."""

    def __init__(self, name: str, ctx: PeerContext, call_timeout_s: Optional[float] = None,
                 opener: Optional[Callable] = None) -> None:
        self.name = name
        self.call_timeout_s = call_timeout_s
        mp = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
        self._conn, child_conn = mp.Pipe()
        self._process = mp.Process(target=_child_main, args=(child_conn, name, ctx, opener), daemon=True,
                                   name=f"kvserve-bench-{name}")
        self._process.start()
        child_conn.close()
        status, value = self._receive(_OPEN_TIMEOUT_S)
        if status == "unavailable":
            self._process.join(5)
            raise PeerUnavailable(value)
        if status == "error":
            self._process.join(5)
            raise RuntimeError(f"{name} failed to start: {value}")

    def _receive(self, timeout_s: Optional[float]) -> tuple[str, Any]:
        try:
            if timeout_s is not None and not self._conn.poll(timeout_s):
                self._kill()
                raise PeerCrashed(f"{self.name} {_describe_exit(None)} within {timeout_s:.0f} s")
            return self._conn.recv()
        except (EOFError, ConnectionResetError, BrokenPipeError):
            self._process.join(5)
            raise PeerCrashed(f"{self.name} {_describe_exit(self._process.exitcode)}") from None

    def _call(self, command: str, *args: Any) -> Any:
        try:
            self._conn.send((command, args))
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._process.join(5)
            raise PeerCrashed(f"{self.name} {_describe_exit(self._process.exitcode)}") from None
        status, value = self._receive(self.call_timeout_s)
        if status == "error":
            raise RuntimeError(f"{self.name}.{command} failed: {value}")
        return value

    def warmup(self) -> None:
        self._call("warmup")

    def run(self, workload: Workload, progress: bool = True) -> EngineRun:
        return self._call("run", workload, progress)

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._call("close")
            except (PeerCrashed, RuntimeError):
                pass
            self._process.join(10)
        self._kill()

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
