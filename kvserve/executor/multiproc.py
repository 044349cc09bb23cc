"""One worker process per rank on this machine; the engine stays in its own process.

Workers are started as ``python -m kvserve.executor.worker`` and connect back to a listener
of the engine (authenticated with a random key), then receive their ``WorkerSpec``.

Each step is pickled once and written to every worker's pipe; rank 0 answers with the
sampled tokens. The engine never blocks without a bound: it waits on rank 0's answer, every
worker's pipe (a worker reports its own failure there) and every worker's process sentinel
(a worker that died), for at most ``timeout_s``. Any of these ends the executor: every worker
is stopped and ``ExecutorError`` names the rank and the cause. The workers' own collectives
carry the same timeout, so a rank whose peer hangs fails instead of waiting for ever.
"""
from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, Listener, wait
from typing import Optional

from kvserve import environment
from kvserve.executor.base import ExecutorError
from kvserve.executor.launch import plan_launch
from kvserve.executor.step import LateBitmasks, StepInput, StepOutput
from kvserve.executor.worker import SHUTDOWN, STATS, WorkerSpec

logger = logging.getLogger("kvserve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    def __init__(self, spec: WorkerSpec, world_size: int, load_timeout_s: float = 600.0) -> None:
        self.world_size = world_size
        self.timeout_s = spec.timeout_s
        self.driver_rank = spec.driver_rank
        self._failed: Optional[str] = None
        self._num_in_flight = 0
        # Seconds the engine's thread spent blocked in collect(), waiting for the workers (the
        # rest of its time is the host's share of the steps).
        self.wait_time_s = 0.0
        launch = plan_launch(world_size)
        listener = Listener((launch.listen_host, launch.listen_port), authkey=launch.authkey)
        address = f"{launch.connect_host}:{listener.address[1]}"
        env = {**os.environ, environment.WORKER_AUTHKEY: launch.authkey.hex()}
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._pidfds: list[int] = []
        # Stop the workers however the engine ends (normal exit, garbage collection).
        self._finalizer = weakref.finalize(self, _stop_workers, self._conns, self._procs, self._pidfds,
                                           launch.rendezvous_dir)
        atexit.register(self._finalizer)
        try:
            for rank in launch.local_ranks:
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvserve.executor.worker", "--engine", address,
                     "--rank", str(rank), "--world-size", str(world_size),
                     "--init-method", launch.init_method, "--die-with-parent"], env=env))
                self._pidfds.append(os.pidfd_open(self._procs[-1].pid))
            by_rank = _accept_all(listener, world_size, self._procs, load_timeout_s)
            self._conns.extend(by_rank)
            for conn in self._conns:
                conn.send_bytes(pickle.dumps(spec))
            ready = self._receive_all(list(range(world_size)), load_timeout_s, "ready")
            self.worker_info = [ready[r] for r in range(world_size)]
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()
        logger.info("%d parallel workers ready (load %.1f s)", world_size,
                    max(i["load_time_s"] for i in self.worker_info))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def is_alive(self) -> bool:
        return self._failed is None and all(p.poll() is None for p in self._procs)

    def execute(self, step: StepInput) -> StepOutput:
        self.submit(step)
        return self.collect()

    def submit(self, step: StepInput) -> None:
        """Send the step to every rank and return: with pipeline stages, the first stage starts
        this step while the last one still works on the previous one (each stage runs its
        steps in the order sent, so a step reads the KV every earlier step wrote)."""
        if self._failed:
            raise ExecutorError(self._failed)
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(data)
        except OSError:
            self._fail(self._death_reason() or "a worker's pipe closed")
        self._num_in_flight += 1

    def collect(self) -> StepOutput:
        if self._num_in_flight == 0:
            raise RuntimeError("collect() without a submitted step")
        self._num_in_flight -= 1
        # A little longer than the workers' own collective timeout: when one rank hangs, the
        # rank waiting for it reports which one first. With a step ahead of it in the
        # pipeline, it waits for that one's stages too.
        t0 = time.perf_counter()
        try:
            return self._receive(self.driver_rank, self.timeout_s * 1.5 + 1.0, "ok")
        finally:
            self.wait_time_s += time.perf_counter() - t0

    def send_late_bitmasks(self, late: LateBitmasks) -> None:
        """(Async scheduling) The bitmasks a submitted step's late constrained requests wait
        for; only the sampling rank reads them, after its forward pass."""
        if self._failed:
            raise ExecutorError(self._failed)
        try:
            self._conns[self.driver_rank].send_bytes(pickle.dumps(late, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._fail(self._death_reason() or "a worker's pipe closed")

    def worker_stats(self) -> list[dict]:
        """Per rank: requests it holds state for, steps run, time in steps and collectives."""
        if self._failed:
            raise ExecutorError(self._failed)
        if self._num_in_flight:
            raise RuntimeError("worker_stats() with steps in flight: collect them first")
        for conn in self._conns:
            conn.send_bytes(STATS)
        got = self._receive_all(list(range(self.world_size)), self.timeout_s, "stats")
        return [got[r] for r in range(self.world_size)]

    def _receive(self, rank: int, timeout_s: float, kind: str):
        """Rank ``rank``'s next message of ``kind``, watching every worker meanwhile."""
        return self._receive_all([rank], timeout_s, kind)[rank]

    def _receive_all(self, ranks: list[int], timeout_s: float, kind: str) -> dict:
        """One message of ``kind`` from each of ``ranks``; any other message, a dead worker or
        the deadline ends the executor."""
        deadline = time.monotonic() + timeout_s
        sentinels = {fd: r for r, fd in enumerate(self._pidfds)}
        got: dict = {}
        while len(got) < len(ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r in ranks if r not in got]
                self._fail(f"no answer from worker rank(s) {missing} within {timeout_s:.0f} s (a rank "
                           f"hung?); stopping all workers")
            ready = wait([*self._conns, *sentinels], timeout=remaining)
            for conn in (c for c in self._conns if c in ready):
                r = self._conns.index(conn)
                try:
                    tag, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail(self._death_reason() or f"worker rank {r} closed its pipe")
                if tag == "error":
                    self._fail(f"worker rank {r} failed: {payload}")
                if r not in ranks or r in got or tag != kind:
                    self._fail(f"worker rank {r}: unexpected message {tag!r}")
                got[r] = payload
            if any(s in ready for s in sentinels):
                self._fail(self._death_reason() or "a worker exited")
        return got

    def _death_reason(self) -> Optional[str]:
        for rank, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                return f"worker rank {rank} (pid {proc.pid}) died ({how})"
        return None

    def _fail(self, reason: str) -> None:
        self._failed = reason
        logger.error("tensor-parallel executor failed: %s", reason)
        self.shutdown()
        raise ExecutorError(reason)

    def prompt_hidden_states(self, token_ids: list[int], chunk_size: int):
        # Each rank holds a slice of every hidden state (or a stage's layers only): pooling
        # would need a gather the workers do not offer yet.
        raise NotImplementedError("hidden states (embeddings) need the model in one process: "
                                  "not served with tensor or pipeline parallelism")

    def shutdown(self) -> None:
        self._finalizer()


def _accept_all(listener: Listener, world_size: int, procs: list[subprocess.Popen],
                timeout_s: float) -> list[Connection]:
    """Every worker's connection, in rank order; ExecutorError if one dies or none comes."""
    accepted: "queue.Queue" = queue.Queue()

    def accept() -> None:
        for _ in range(world_size):
            try:
                conn = listener.accept()
                tag, rank = pickle.loads(conn.recv_bytes())
                accepted.put((rank, conn))
            except (OSError, EOFError) as exc:  # listener closed (failure) or a bad client
                accepted.put((None, exc))
                return

    threading.Thread(target=accept, name="kvserve-accept", daemon=True).start()
    conns: dict[int, Connection] = {}
    deadline = time.monotonic() + timeout_s
    while len(conns) < world_size:
        for rank, proc in enumerate(procs):
            if proc.poll() is not None:
                raise ExecutorError(f"worker rank {rank} (pid {proc.pid}) exited with code "
                                    f"{proc.returncode} before connecting")
        if time.monotonic() > deadline:
            raise ExecutorError(f"workers did not connect within {timeout_s:.0f} s")
        try:
            rank, conn = accepted.get(timeout=0.2)
        except queue.Empty:
            continue
        if rank is None:
            raise ExecutorError(f"accepting workers failed: {conn}")
        conns[rank] = conn
    return [conns[r] for r in range(world_size)]


def _stop_workers(conns: list[Connection], procs: list[subprocess.Popen], pidfds: list[int],
                  rendezvous_dir: Optional[str] = None, grace_s: float = 5.0) -> None:
    for conn in conns:
        try:
            conn.send_bytes(SHUTDOWN)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=grace_s)
    for conn in conns:
        conn.close()
    for fd in pidfds:
        os.close(fd)
    pidfds.clear()
    if rendezvous_dir is not None:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
