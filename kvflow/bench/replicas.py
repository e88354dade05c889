"""The replicas behind a router, each read from its own /metrics around a run (`kvflow bench
--replica-metrics URL ...`): the router's endpoint shows the load as one server, so which replica
served what, and at what prefix hit rate, comes only from the replicas themselves."""

from __future__ import annotations

from typing import Any

import httpx

from kvflow.bench.gauges import GaugeSamples, sample_gauges
from kvflow.bench.server_metrics import Snapshot, scrape
from kvflow.bench.server_view import server_section


class ReplicaScrapes:
    def __init__(self, metrics_urls: tuple[str, ...]) -> None:
        self.urls = metrics_urls
        self.before: list[Snapshot | None] = [None] * len(metrics_urls)
        self.after: list[Snapshot | None] = [None] * len(metrics_urls)
        self.gauges = [GaugeSamples() for _ in metrics_urls]

    def scrape_before(self, headers: dict[str, str] | None) -> None:
        self.before = [scrape(url, headers) for url in self.urls]

    def scrape_after(self, headers: dict[str, str] | None) -> None:
        self.after = [scrape(url, headers) for url in self.urls]

    def samplers(self, http: httpx.AsyncClient, interval_s: float) -> list[Any]:
        """One gauge sampler per replica (running, waiting, KV usage over the run)."""
        return [
            sample_gauges(http, url, interval_s, g) for url, g in zip(self.urls, self.gauges, strict=True)
        ]

    def sections(self) -> list[dict[str, Any]]:
        """Each replica's server section (kvflow/bench/server_view.py), with its URL."""
        return [
            {"metrics_url": url, **server_section(before, after, None, gauges)}
            for url, before, after, gauges in zip(
                self.urls, self.before, self.after, self.gauges, strict=True
            )
        ]
