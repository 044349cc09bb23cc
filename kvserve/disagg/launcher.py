"""``kvserve serve --disaggregate``: one host, one command. A prefill and a decode instance
(``kvserve serve --disaggregation-mode ...`` child processes, each pinned to its own CPUs and
given as many torch threads), joined by the shared-memory connector, behind the router on the
address the user asked for.

The launcher supervises its children: one that exits while serving is restarted on the same
port (the router's health checks fail its requests meanwhile and take it back once it answers
again); stopping the launcher stops both.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from kvserve.disagg.router import RouterConfig, run_router
from kvserve.errors import ConfigError

logger = logging.getLogger("kvserve")

# Flags of `kvserve serve` that belong to the launcher, not to its instances (and how many
# values each takes).
LAUNCHER_FLAGS = {"--disaggregate": 0, "--prefill-cpus": 1, "--decode-cpus": 1, "--host": 1, "--port": 1,
                  "--cpus": 1, "--disaggregation-mode": 1, "--kv-connector": 1, "--num-threads": 1}


def parse_cpus(text: str) -> list[int]:
    """"0", "0-3", "0,2,4-5" -> CPU numbers; ConfigError for anything else or CPUs this
    process may not run on."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigError(f"not a CPU list: {text!r} (e.g. 0, 0-3, 0,2)") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not set(cpus) <= allowed:
        raise ConfigError(f"CPU list {text!r} is not within the CPUs this process may use {sorted(allowed)}")
    return sorted(set(cpus))


def pin_to_cpus(cpus: list[int]) -> None:
    """Run this process (and the threads it starts from now on: torch's pool) on ``cpus``."""
    os.sched_setaffinity(0, cpus)


def instance_argv(serve_argv: list[str]) -> list[str]:
    """``serve_argv`` without the launcher's own flags (both ``--flag value`` and ``--flag=value``)."""
    out, i = [], 0
    while i < len(serve_argv):
        arg = serve_argv[i]
        name = arg.split("=", 1)[0]
        if name in LAUNCHER_FLAGS:
            i += 1 + (LAUNCHER_FLAGS[name] if "=" not in arg else 0)
            continue
        out.append(arg)
        i += 1
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ChildInstance:
    role: str
    argv: list[str]
    port: int
    proc: Optional[subprocess.Popen] = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, preexec_fn=_stop_with_parent)


def _stop_with_parent() -> None:
    """In the child: a SIGTERM when the launcher dies, however it dies (no orphan instances)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class DisaggregatedLauncher:
    serve_argv: list[str]
    prefill_cpus: list[int]
    decode_cpus: list[int]
    connector: str = "shm"
    children: list[ChildInstance] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if set(self.prefill_cpus) & set(self.decode_cpus):
            raise ConfigError(f"--prefill-cpus {self.prefill_cpus} and --decode-cpus {self.decode_cpus} overlap: "
                              f"the point is that prompts never take the decode side's cores")
        argv = list(self.serve_argv)
        if any(a == "--kv-cache-memory=auto" or (a == "--kv-cache-memory" and argv[i + 1:i + 2] == ["auto"])
               for i, a in enumerate(argv)):
            raise ConfigError("--kv-cache-memory auto sizes a pool from the memory free at start-up: the two "
                              "instances start together and would each take it; give --disaggregate a byte count "
                              "(each instance gets that much)")
        base = instance_argv(self.serve_argv)
        for role, cpus in (("prefill", self.prefill_cpus), ("decode", self.decode_cpus)):
            port = _free_port()
            argv = [sys.executable, "-m", "kvserve.cli", "serve", *base, "--disaggregation-mode", role,
                    "--kv-connector", self.connector, "--cpus", ",".join(map(str, cpus)),
                    "--num-threads", str(len(cpus)), "--host", "127.0.0.1", "--port", str(port)]
            self.children.append(ChildInstance(role, argv, port))

    def start(self, ready_timeout_s: float = 900.0) -> None:
        for child in self.children:
            child.start()
        deadline = time.monotonic() + ready_timeout_s
        for child in self.children:
            while True:
                if child.proc.poll() is not None:
                    self.stop()
                    raise ConfigError(f"the {child.role} instance exited with code {child.proc.returncode} "
                                      f"before it was ready (its log is above)")
                try:
                    if httpx.get(child.url + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise ConfigError(f"the {child.role} instance was not ready within {ready_timeout_s:.0f} s")
                time.sleep(0.5)
        threading.Thread(target=self._supervise, name="kvserve-supervisor", daemon=True).start()

    def _supervise(self) -> None:
        while not self._stopping.wait(1.0):
            for child in self.children:
                code = child.proc.poll()
                if code is not None and not self._stopping.is_set():
                    child.restarts += 1
                    logger.error("the %s instance exited (code %s); restarting it (restart %d)",
                                 child.role, code, child.restarts)
                    child.start()

    def stop(self, grace_s: float = 20.0) -> None:
        self._stopping.set()
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def router_config(self, **kwargs) -> RouterConfig:
        return RouterConfig(prefill_urls=[c.url for c in self.children if c.role == "prefill"],
                            decode_urls=[c.url for c in self.children if c.role == "decode"], **kwargs)


def run_disaggregated(serve_argv: list[str], prefill_cpus: str, decode_cpus: str, host: str, port: int,
                      connector: str = "shm", log_level: str = "info") -> None:
    launcher = DisaggregatedLauncher(serve_argv, parse_cpus(prefill_cpus), parse_cpus(decode_cpus), connector)
    # uvicorn re-raises the SIGTERM it drained on after its shutdown: as SystemExit, the
    # instances are stopped below rather than left to their death signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    launcher.start()
    logger.warning("disaggregated: prefill on CPUs %s (%s), decode on CPUs %s (%s), %s connector",
                   launcher.prefill_cpus, launcher.children[0].url, launcher.decode_cpus,
                   launcher.children[1].url, connector)
    try:
        run_router(launcher.router_config(), host=host, port=port, log_level=log_level)
    finally:
        launcher.stop()
