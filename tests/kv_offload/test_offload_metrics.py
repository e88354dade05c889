"""The tier's counters on /metrics (kvflow/server/kv_offload_metrics.py), read at scrape time."""

from __future__ import annotations

import hashlib
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvflow.kv_offload.disk_tier import DiskKVTier
from kvflow.server.kv_offload_metrics import register_kv_offload_metrics


def test_tier_counters_are_exported_as_they_change(tmp_path: Path) -> None:
    tier = DiskKVTier(tmp_path, 1 << 20, hashlib.sha256(b"m").digest())
    registry = CollectorRegistry()
    register_kv_offload_metrics(registry, tier, "tiny")
    before = generate_latest(registry).decode()
    assert 'kvflow:kv_offload_blocks_stored_total{model_name="tiny"} 0.0' in before
    tier.store(b"h" * 32, b"x" * 100)
    tier.flush()
    assert tier.load(b"h" * 32) == b"x" * 100
    after = generate_latest(registry).decode()
    assert 'kvflow:kv_offload_blocks_stored_total{model_name="tiny"} 1.0' in after
    assert 'kvflow:kv_offload_blocks_restored_total{model_name="tiny"} 1.0' in after
    assert 'kvflow:kv_offload_blocks{model_name="tiny"} 1.0' in after
