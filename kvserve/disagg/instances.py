"""The router's view of its prefill and decode instances: which are healthy, how busy each
is, which requests wait on each. Torch-free and free of HTTP: the router feeds it health
checks and request starts/ends."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Instance:
    url: str
    role: str  # "prefill" | "decode"
    healthy: bool = True
    consecutive_failures: int = 0
    in_flight: int = 0
    down_reason: Optional[str] = None
    # The requests waiting on this instance's answer: failed at once when it is found down.
    waiters: set = field(default_factory=set)


class InstancePool:
    """``unhealthy_after``: consecutive failed health checks before an instance counts as down
    (one check that cannot even connect is enough: the process is gone)."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], unhealthy_after: int = 3) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("a router needs at least one prefill and one decode instance")
        self.unhealthy_after = unhealthy_after
        self.instances = ([Instance(u.rstrip("/"), "prefill") for u in prefill_urls]
                          + [Instance(u.rstrip("/"), "decode") for u in decode_urls])

    def of_role(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    def pick(self, role: str) -> Optional[Instance]:
        """The healthy instance of ``role`` with the fewest requests in flight (the first on ties)."""
        healthy = [i for i in self.of_role(role) if i.healthy]
        return min(healthy, key=lambda i: i.in_flight) if healthy else None

    def check_passed(self, instance: Instance) -> None:
        instance.consecutive_failures = 0
        instance.healthy = True
        instance.down_reason = None

    def check_failed(self, instance: Instance, reason: str, unreachable: bool) -> bool:
        """Record a failed health check; True when this makes the instance down (its waiters
        are then failed with ``reason``)."""
        instance.consecutive_failures += 1
        if instance.healthy and (unreachable or instance.consecutive_failures >= self.unhealthy_after):
            instance.healthy = False
            instance.down_reason = reason
            for waiter in list(instance.waiters):
                if isinstance(waiter, asyncio.Future) and not waiter.done():
                    waiter.set_exception(InstanceDown(f"{instance.role} instance {instance.url} is down: {reason}"))
            return True
        return False


class InstanceDown(RuntimeError):
    pass
