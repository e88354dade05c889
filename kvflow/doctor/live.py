"""The doctor on a running kvflow server's own window: the dashboard's "doctor" view.

The dashboard (server/dashboard/) hands over the last N minutes as the server saw them: finished
requests (server-side TTFT and E2E, from arrival), every inter-token gap, and /metrics at the
window's start, during it and now. They become a `kvflow bench` result, so the diagnosis is exactly
`kvflow doctor --bench`'s, with two differences said on the page: latencies are the server's
(no network, no client), and a request's cached prompt tokens stand in for its shared prefix.
"""

from __future__ import annotations

import html
import threading
from dataclasses import replace
from typing import Any

from kvflow.bench.gauges import GaugeSamples
from kvflow.bench.metrics import summarize
from kvflow.bench.server_metrics import engine_config, parse_metrics
from kvflow.bench.server_view import server_section
from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.evidence import evidence_from_bench
from kvflow.doctor.findings import diagnose
from kvflow.doctor.hardware import Hardware, named_hardware
from kvflow.doctor.model_spec import DTYPE_BYTES, ModelSpec, default_kv_dtype
from kvflow.doctor.report import doctor_json, html_report
from kvflow.doctor.roofline import Roofline
from kvflow.doctor.server_settings import EngineSettings
from kvflow.server.dashboard.doctor_window import DoctorWindow


def window_result(window: DoctorWindow) -> dict[str, Any]:
    """The window as a `kvflow bench` result (the fields evidence_from_bench reads)."""
    ok = [r for r in window.requests if r["reason"] != "abort" and r["ttft_ms"] is not None]
    if not ok:
        raise ValueError(
            "no request finished in the dashboard's window yet: send some load, then ask the doctor again"
        )
    entries = [_request_entry(r, window.started) for r in ok]
    duration = max(window.now - window.started, 1e-9)
    output_tokens = sum(e["output_tokens"] for e in entries)
    before, after = (
        parse_metrics(window.metrics_before.decode()),
        parse_metrics(window.metrics_after.decode()),
    )
    gauges = GaugeSamples()
    for text in window.metrics_samples:
        gauges.add(parse_metrics(text.decode()))
    ttft = summarize(e["ttft_ms"] for e in entries)
    return {
        "config": {"endpoint": "completions", "source": "kvflow serve's dashboard window"},
        "completed": len(entries),
        "duration_s": duration,
        "output_throughput": output_tokens / duration,
        "ttft_ms": ttft,
        "tpot_ms": summarize(e["tpot_ms"] for e in entries),
        "itl_ms": summarize(window.itl_ms),
        "e2e_ms": summarize(e["e2e_ms"] for e in entries),
        "server": server_section(before, after, ttft["mean"], gauges, num_requests=len(entries)),
        "requests": entries,
    }


def _request_entry(r: dict[str, Any], started: float) -> dict[str, Any]:
    e2e_ms = None if r["last_token"] is None else (r["last_token"] - r["arrival"]) * 1e3
    n_out = r["output_tokens"]
    tpot = (e2e_ms - r["ttft_ms"]) / (n_out - 1) if e2e_ms is not None and n_out >= 2 else None
    return {
        "send_s": max(0.0, r["arrival"] - started),
        "ttft_ms": r["ttft_ms"],
        "e2e_ms": e2e_ms,
        "tpot_ms": tpot,
        "prompt_tokens": r["prompt_tokens"],
        "shared_prefix_tokens": r["cached_tokens"],
        "output_tokens": n_out,
        "error": None,
        "itl_ms": [],  # the window's gaps are pooled (DoctorWindow.itl_ms), not kept per request
    }


def _settings(metrics_text: bytes) -> EngineSettings:
    exported = engine_config(parse_metrics(metrics_text.decode()))
    return EngineSettings() if exported is None else EngineSettings.from_labels(exported[1], exported[0])


class LiveDiagnosis:
    """The `LiveDoctor` kvflow serve passes to its dashboard. The hardware is measured once, at the
    first call (a few seconds of CPU beside the serving engine), then reused."""

    def __init__(self, hardware: str = "cpu") -> None:
        self.hardware_name = hardware
        self._hardware: Hardware | None = None
        self._lock = threading.Lock()

    def hardware(self) -> Hardware:
        with self._lock:
            if self._hardware is None:
                self._hardware = named_hardware(self.hardware_name)
            return self._hardware

    def __call__(self, window: DoctorWindow) -> str:
        result = window_result(window)
        settings = _settings(window.metrics_after)
        model = ModelSpec.from_dir(window.model_dir)
        run = replace(evidence_from_bench(result), itl_gaps_ms=list(window.itl_ms))
        weight_dtype = settings.weight_dtype or model.weight_dtype
        float_dtype = settings.dtype if settings.dtype in DTYPE_BYTES else model.dtype
        kv_dtype = settings.kv_cache_dtype or default_kv_dtype(weight_dtype, float_dtype)
        roofline = Roofline(model, self.hardware(), weight_dtype, kv_dtype)
        diagnosis = Diagnosis(model, roofline, run, settings, measured=True)
        doc = doctor_json(diagnosis, diagnose(diagnosis))
        minutes = (window.now - window.started) / 60
        note = (
            f"The live window: the last {minutes:.1f} minutes of this server, {result['completed']} finished "
            "requests. Latencies are the server's own (from arrival; no network), and cached prompt "
            "tokens stand in for shared prefixes."
        )
        back = "<a href='/dashboard'>back to the live dashboard</a>"
        return html_report(doc, note=f"{html.escape(note)} {back}")
