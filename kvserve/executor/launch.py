"""Where a parallel group's ranks come from: all started here (one machine), or started by
``torchrun`` on several machines, with the engine (and server) on rank 0.

Under torchrun every process runs the same ``kvserve serve`` command. Rank 0 runs the
engine, listens for the other ranks at ``MASTER_ADDR:MASTER_PORT + 1`` (or
``KVSERVE_ENGINE_PORT``) and starts its own rank-0 worker; every other rank becomes a worker
that connects there. All ranks join torch.distributed through torchrun's environment
(``env://``). The connection is authenticated with ``KVSERVE_WORKER_AUTHKEY`` (hex), which
must be the same on every machine: the engine and the workers exchange pickles.
"""
from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass
from typing import Optional

from kvserve import environment
from kvserve.config import ConfigError


@dataclass(frozen=True)
class Launch:
    listen_host: str  # the engine's listener
    listen_port: int  # 0: any free port
    connect_host: str  # how workers reach the listener
    init_method: str  # torch.distributed rendezvous
    local_ranks: tuple[int, ...]  # ranks the engine starts as child processes
    authkey: bytes
    rendezvous_dir: Optional[str] = None  # the file store's directory (one machine), removed at shutdown


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def engine_address() -> tuple[str, int]:
    port = environment.engine_port() or int(os.environ["MASTER_PORT"]) + 1
    return os.environ["MASTER_ADDR"], port


def shared_authkey() -> bytes:
    key = environment.worker_authkey()
    if not key:
        raise ConfigError("a multi-node launch needs KVSERVE_WORKER_AUTHKEY (the same hex key on "
                          "every node, e.g. from `python -c 'import secrets; print(secrets.token_hex(16))'`)")
    try:
        return bytes.fromhex(key)
    except ValueError:
        raise ConfigError("KVSERVE_WORKER_AUTHKEY must be hex") from None


def plan_launch(world_size: int) -> Launch:
    if not under_torchrun():
        # A file store rather than a TCP port: a port found free here could be taken by another
        # process before rank 0's store binds it, seconds later, once its worker has started
        # (seen as EADDRINUSE on a shared machine). The store wants a file that does not exist yet.
        rendezvous_dir = tempfile.mkdtemp(prefix="kvserve-rendezvous-")
        return Launch("127.0.0.1", 0, "127.0.0.1", f"file://{rendezvous_dir}/store",
                      tuple(range(world_size)), secrets.token_bytes(16), rendezvous_dir)
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world != world_size:
        raise ConfigError(f"torchrun started {env_world} processes but the parallel group has "
                          f"{world_size} ranks (tensor_parallel_size x pipeline_parallel_size)")
    host, port = engine_address()
    return Launch("0.0.0.0", port, host, "env://", (0,), shared_authkey())


def run_torchrun_worker(connect_timeout_s: float = 300.0) -> int:
    """The body of a torchrun rank other than 0: connect to the engine (retrying while it
    loads) and serve steps until it goes away."""
    import time
    from multiprocessing.connection import Client

    from kvserve.executor.worker import worker_main

    host, port = engine_address()
    authkey = shared_authkey()
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            conn = Client((host, port), authkey=authkey)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise ConfigError(f"no kvserve engine at {host}:{port} after {connect_timeout_s:.0f} s")
            time.sleep(0.5)
    worker_main(conn, torchrun_rank(), int(os.environ["WORLD_SIZE"]), "env://")
    return 0
