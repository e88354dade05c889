"""The KV offload tier's counters on /metrics (kvflow/kv_offload/disk_tier.py TierStats), read at
scrape time: the tier's writer and reader threads count as they go, so the engine loop never
touches Prometheus for them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvflow.kv_offload.disk_tier import DiskKVTier
from kvflow.server.metrics import LABELS, PREFIX

# name -> (TierStats field, help)
_COUNTERS = {
    "kv_offload_blocks_stored": ("blocks_stored", "KV blocks written to the offload tier"),
    "kv_offload_bytes_written": ("bytes_written", "bytes written to the offload tier"),
    "kv_offload_blocks_evicted": ("blocks_evicted", "tier blocks deleted to stay within its size (LRU)"),
    "kv_offload_blocks_restored": (
        "blocks_read",
        "KV blocks read back from the tier (prefix hits past the pool)",
    ),
    "kv_offload_bytes_read": ("bytes_read", "bytes read back from the offload tier"),
    "kv_offload_read_seconds": ("read_seconds", "seconds spent reading tier blocks (off the engine step)"),
    "kv_offload_write_errors": ("write_errors", "tier writes that failed (full disk, missing directory)"),
    "kv_offload_read_errors": ("read_errors", "tier blocks found damaged or missing on read (recomputed)"),
    "kv_offload_files_skipped": ("files_skipped", "torn or foreign files skipped when the index was rebuilt"),
}


class KVOffloadCollector(Collector):
    def __init__(self, tier: DiskKVTier, model_name: str) -> None:
        self.tier = tier
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.tier.stats
        for name, (field, doc) in _COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric([self.model_name], float(getattr(stats, field)))
            yield family
        for name, value, doc in (
            ("kv_offload_blocks", self.tier.num_blocks, "KV blocks the offload tier holds"),
            ("kv_offload_bytes", self.tier.num_bytes, "bytes the offload tier holds on disk"),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
            gauge.add_metric([self.model_name], float(value))
            yield gauge


def register_kv_offload_metrics(registry: CollectorRegistry, tier: DiskKVTier, model_name: str) -> None:
    registry.register(KVOffloadCollector(tier, model_name))
