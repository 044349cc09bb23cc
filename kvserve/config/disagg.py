"""What makes an engine one side of a disaggregated pair: its role and its KV connector."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvserve.errors import ConfigError

ROLES = ("prefill", "decode")
CONNECTORS = ("shm", "tcp")


@dataclass
class DisaggConfig:
    """``role``: a prefill instance computes prompts and publishes their KV; a decode instance
    receives it and generates. ``connector``: how the KV moves, "shm" (a file in /dev/shm per
    transfer: one host) or "tcp" (the prefill instance serves its staged KV on ``kv_host``:
    ``kv_port``; two hosts). Both sides of a pair must use the same connector.

    ``kv_advertise_host``: the address a decode instance dials (the prefill's ``kv_host`` when
    unset; give the host's reachable name when binding 0.0.0.0). ``staging_ttl_s``: how long a
    prefill instance keeps a transfer nobody fetched (a decode side that never came, a client
    gone between the two). ``staging_capacity_bytes``: the most staged KV a prefill instance
    holds; past it the oldest transfers go (their decode sides re-prefill). ``load_timeout_s``:
    a decode side's bound on one transfer (connect, each read); past it the transfer has
    failed and the request is re-prefilled locally."""

    role: str
    connector: str = "shm"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0  # 0: any free port (the address travels with each transfer)
    kv_advertise_host: Optional[str] = None
    shm_dir: str = "/dev/shm"
    staging_ttl_s: float = 60.0
    staging_capacity_bytes: int = 4 << 30
    load_timeout_s: float = 10.0
    max_concurrent_loads: int = 4

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"unknown disaggregation role {self.role!r}; use one of {', '.join(ROLES)}")
        if self.connector not in CONNECTORS:
            raise ConfigError(f"unknown KV connector {self.connector!r}; use one of {', '.join(CONNECTORS)}")
        if not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_port must be in [0, 65535], got {self.kv_port}")
        if self.staging_ttl_s <= 0 or self.load_timeout_s <= 0:
            raise ConfigError("staging_ttl_s and load_timeout_s must be positive")
        if self.staging_capacity_bytes < 1:
            raise ConfigError("staging_capacity_bytes must be positive")
        if self.max_concurrent_loads < 1:
            raise ConfigError("max_concurrent_loads must be >= 1")
