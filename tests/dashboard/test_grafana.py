"""examples/grafana/kvflow.json: every series it queries is one a kvflow server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from fixtures.live_server import LiveServer

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvflow.json"


def test_grafana_dashboard_queries_exported_series(server: LiveServer) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"kvflow:[a-z0-9_]+", expr)}
    # Declared families (`# TYPE`: a counter no request has touched yet has no sample) and samples.
    text = httpx.get(server.base_url + "/metrics").text
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))
    histograms = {name + "_bucket" for name, kind in families.items() if kind == "histogram"}
    exported = set(server.scrape()) | set(families) | histograms
    assert queried and queried <= exported, sorted(queried - exported)
    # Every query is scoped to the chosen model and reads the chosen data source.
    assert all('model_name="$model_name"' in expr for expr in exprs)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model_name"} <= variables
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
