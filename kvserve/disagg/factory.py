"""Builds the connector a DisaggConfig names."""
from __future__ import annotations

from kvserve.config.disagg import DisaggConfig
from kvserve.disagg.connector import KVConnector
from kvserve.disagg.staging import StagingArea
from kvserve.disagg.stats import TransferStats


def make_connector(config: DisaggConfig, stats: TransferStats) -> KVConnector:
    """The connector of ``config``'s kind; a prefill instance's TCP connector serves its
    staged transfers on ``kv_host:kv_port``."""
    staging = StagingArea(config.staging_ttl_s, config.staging_capacity_bytes)
    if config.connector == "shm":
        from kvserve.disagg.shm_connector import SharedMemoryConnector
        return SharedMemoryConnector(staging, stats, config.shm_dir)
    from kvserve.disagg.tcp_connector import TCPConnector
    return TCPConnector(staging, stats, config.kv_host, config.kv_port, config.kv_advertise_host,
                        serve=config.role == "prefill")
