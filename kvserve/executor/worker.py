"""One rank of a tensor-parallel group, in its own process:
``python -m kvserve.executor.worker --engine HOST:PORT --rank R --world-size N --init-method URL``
with the engine's key in ``KVSERVE_WORKER_AUTHKEY`` (hex). A plain command rather than a
multiprocessing child: no re-import of the caller's ``__main__`` (a script that builds an
engine at top level works), and a worker on another machine starts the same way.

The worker connects to the engine, receives its ``WorkerSpec``, joins the torch.distributed
group, loads its shard of the model and its shard of the KV cache (its KV heads, its stage's
layers in the engine's KV cache groups, every block), then runs steps as the engine sends them
over its pipe: pickled ``StepInput`` bytes in, and from rank 0 (the rank that samples) a pickled
``StepOutput`` back. Any failure is reported on the pipe before the process exits, so the
engine can name it; a worker whose engine goes away (pipe closed, or the engine process
killed: the parent-death signal) exits too, leaving no orphans.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Optional, Union

import torch

from kvserve import environment
from kvserve.config import KernelConfig

if TYPE_CHECKING:
    from kvserve.executor.step import LateBitmasks
    from kvserve.kv_cache import KVCacheGroup

logger = logging.getLogger("kvserve.worker")

# Control messages (bytes) besides pickled steps.
SHUTDOWN = b"shutdown"
STATS = b"stats"  # every rank answers ("stats", {...}): tests and benchmarks read them


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard; picklable."""

    model: str
    dtype: torch.dtype
    weight_format: Optional[str]
    kv_dtype: Union[str, torch.dtype]
    block_size: int
    num_blocks: int
    device: str
    num_threads: int
    timeout_s: float
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Every rank on this machine: the path prefix of the shared-memory collectives' buffers.
    shm_path: Optional[str] = None
    int4_prefill: str = "auto"  # EngineArgs.int4_prefill
    # The KV manager's groups (kv_cache_groups; global layer indices): one block table per
    # group in every step. Empty: one full group of every layer.
    kv_groups: tuple[KVCacheGroup, ...] = ()
    # EngineArgs.kernel_config as the user gave it: each worker resolves it against its own CPU.
    kernel_config: KernelConfig = KernelConfig()
    # EngineArgs.async_scheduling: the runner keeps each request's sampled tokens itself and
    # the sampling rank reads late grammar bitmasks from its pipe (ModelRunner).
    async_scheduling: bool = False

    @property
    def driver_rank(self) -> int:
        """The rank that samples and answers the engine: the last stage's first rank."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


def _receive_late_bitmasks(conn: Connection) -> "LateBitmasks":
    """The engine's next message, which must be the late bitmasks of the step being run."""
    from kvserve.executor.step import LateBitmasks

    data = conn.recv_bytes()
    if data == SHUTDOWN:
        raise EOFError("the engine stopped in the middle of a step")
    late = pickle.loads(data)
    if not isinstance(late, LateBitmasks):
        raise RuntimeError(f"expected the step's late grammar bitmasks, got {type(late).__name__}")
    return late


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the engine process dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_main(conn: Connection, rank: int, world_size: int, init_method: str) -> None:
    try:
        conn.send_bytes(pickle.dumps(("hello", rank)))
        spec: WorkerSpec = pickle.loads(conn.recv_bytes())
        _serve(conn, rank, world_size, init_method, spec)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the engine went away: nothing to report to
    except BaseException as exc:  # report, then exit non-zero
        try:
            conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n"
                                                   f"{traceback.format_exc(limit=8)}")))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)


def _serve(conn: Connection, rank: int, world_size: int, init_method: str, spec: WorkerSpec) -> None:
    from kvserve.distributed import init_process_group, stage_layers
    from kvserve.loader import load_config, load_model, resolve_model
    from kvserve.models.tensor_parallel import stage_kv_spec
    from kvserve.executor.runner import ModelRunner
    from kvserve.ops import apply_kernel_config

    torch.set_num_threads(spec.num_threads)
    t0 = time.perf_counter()
    device = torch.device(spec.device)
    if device.type == "cuda" and device.index is None:
        # One GPU per rank on its machine (NCCL refuses two ranks on one device). Untested
        # here: no GPU on the development machines.
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    kernels = spec.kernel_config
    apply_kernel_config(kernels)
    tp, pp = init_process_group(rank, world_size, init_method, device, spec.timeout_s,
                                spec.tensor_parallel_size, spec.pipeline_parallel_size,
                                spec.shm_path if kernels.shm_collectives else None,
                                time_comm=kernels.time_collectives)
    source = resolve_model(spec.model)
    full_cfg = load_config(source)
    layer_range = (0, full_cfg.num_hidden_layers)
    if pp is not None:
        pp.layer_range = layer_range = stage_layers(full_cfg.num_hidden_layers, pp.num_stages, pp.stage)
    model, _ = load_model(source, dtype=spec.dtype, device=device,
                          quantization=spec.weight_format, tp=tp, pp=pp,
                          int4_prefill=spec.int4_prefill)
    local_cfg = model.config  # per-rank head counts and widths
    # This rank's KV: its heads, its stage's layers in the engine's groups (each layer in the
    # group and slot the stage's cut of them gives it: the engine's table g is group g's), and
    # every block, the null block among them.
    kv_spec = stage_kv_spec(full_cfg, spec.tensor_parallel_size, layer_range, spec.block_size, spec.kv_dtype,
                            spec.kv_groups)
    driver = rank == spec.driver_rank
    runner = ModelRunner(model, local_cfg, kv_spec, spec.num_blocks, device, samples=driver)
    if spec.async_scheduling:
        runner.appends_sampled_tokens = True
        runner.receive_late_bitmasks = lambda: _receive_late_bitmasks(conn)
    if len(runner.kv_cache) != len(model.model.layers):  # the model zips its layers with the cache's
        raise RuntimeError(f"KV cache of {len(runner.kv_cache)} layers for {len(model.model.layers)} model layers")
    conn.send_bytes(pickle.dumps(("ready", {"rank": rank, "pid": os.getpid(),
                                            "load_time_s": time.perf_counter() - t0,
                                            "kv_heads": local_cfg.num_key_value_heads})))
    num_steps, step_time_s = 0, 0.0
    try:
        while True:
            data = conn.recv_bytes()
            if data == SHUTDOWN:
                break
            if data == STATS:
                conn.send_bytes(pickle.dumps(("stats", {
                    "rank": rank, "num_requests": len(runner.requests), "steps": num_steps,
                    "step_time_s": step_time_s, "comm_time_s": tp.comm_time_s,
                    "kv_cache_bytes": runner.kv_cache.num_bytes})))
                continue
            t_step = time.perf_counter()
            step = pickle.loads(data)
            out = runner.execute(step)
            num_steps += 1
            step_time_s += time.perf_counter() - t_step
            if driver:
                conn.send_bytes(pickle.dumps(("ok", out), protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    from multiprocessing.connection import Client

    parser = argparse.ArgumentParser(prog="python -m kvserve.executor.worker")
    parser.add_argument("--engine", required=True, help="HOST:PORT of the engine's listener")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="torch.distributed init URL")
    parser.add_argument("--die-with-parent", action="store_true")
    ns = parser.parse_args(argv)
    if ns.die_with_parent:
        _die_with_parent()
    host, port = ns.engine.rsplit(":", 1)
    authkey = bytes.fromhex(environment.worker_authkey() or "")
    conn = Client((host, int(port)), authkey=authkey)
    worker_main(conn, ns.rank, ns.world_size, ns.init_method)
    # Skip the interpreter's teardown (seconds, in torch's and gloo's destructors): the
    # worker has nothing left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
