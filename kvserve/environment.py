"""The environment variables kvserve reads, all of them, in one place.

Only secrets, paths and addresses come from the environment; everything that changes what the
engine computes is an ``EngineArgs`` field (kernel routes and numerics: ``KernelConfig``), so a
run's configuration is in its config and two engines in one process can differ.

- ``KVSERVE_API_KEY``: the server's API key (``kvserve serve --api-key`` overrides it).
- ``KVSERVE_WORKER_AUTHKEY``: hex key that engine and worker processes on several machines
  share (they exchange pickles).
- ``KVSERVE_CACHE_DIR``: where assembled models, converted tokenizers and peers' files are
  cached (default ``~/.cache/kvserve``).
- ``KVSERVE_ENGINE_PORT``: the port workers started by torchrun reach the engine on (default
  ``MASTER_PORT + 1``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

API_KEY = "KVSERVE_API_KEY"
WORKER_AUTHKEY = "KVSERVE_WORKER_AUTHKEY"
CACHE_DIR = "KVSERVE_CACHE_DIR"
ENGINE_PORT = "KVSERVE_ENGINE_PORT"


def api_key() -> Optional[str]:
    return os.environ.get(API_KEY) or None


def worker_authkey() -> Optional[str]:
    """The hex key as set, or None."""
    return os.environ.get(WORKER_AUTHKEY) or None


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR) or Path.home() / ".cache" / "kvserve")


def engine_port() -> Optional[int]:
    value = os.environ.get(ENGINE_PORT)
    return int(value) if value else None
