"""How closely the calibrated simulator reproduces the run it was fitted on (Vidur's validation:
simulated against measured latency percentiles of the same requests under the same settings).

The client's TTFT is the simulated server TTFT plus the measured client offset (delivery and the
client, kvflow/doctor/calibrate.py; each client's first request its own, it opened the connection);
ITL is the server's cadence, which the client sees directly. The replay is FIDELITY_REPLAYS seeds
pooled, the expected percentiles of the simulator, not one draw of them.
Used by benchmarks/simulator_fidelity.py and the recorded-run tests (tests/doctor/
test_simulator_fidelity.py), which report the same table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.bench.metrics import percentile
from kvflow.doctor.calibrate import Calibration, calibrate
from kvflow.doctor.evidence import evidence_from_bench
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.server_settings import settings_from_result
from kvflow.doctor.step_profile import StepProfile

# metric -> (the bench result's latency section, the percentile)
FIDELITY_METRICS: dict[str, tuple[str, float]] = {
    "ttft_p50_ms": ("ttft_ms", 50),
    "ttft_p99_ms": ("ttft_ms", 99),
    "itl_p50_ms": ("itl_ms", 50),
    "itl_p99_ms": ("itl_ms", 99),
}


# Replays pooled (seeds of the step and client-gap draws): a TTFT p99 over one replay of 64 requests
# is its slowest request, and one changed draw had moved it 10.2 -> 15.7 ms (session 29).
FIDELITY_REPLAYS = 8


@dataclass(frozen=True)
class FidelityRow:
    metric: str
    measured: float
    simulated: float

    @property
    def error(self) -> float:
        """|simulated - measured| / measured."""
        return abs(self.simulated - self.measured) / self.measured if self.measured > 0 else float("inf")


def fidelity(calibration: Calibration, result: dict[str, Any]) -> list[FidelityRow]:
    """Each of FIDELITY_METRICS, measured (the bench result) against the calibrated baseline."""
    ev, offset = calibration.evidence, calibration.client_gap_ms
    run = calibration.replays(ev.requests, calibration.settings, replicas=FIDELITY_REPLAYS)
    # Each client's first request opened its connection: its own offset (2-4x the others' on the
    # planted runs), which a TTFT p99 over a few dozen requests is made of.
    first = ev.client_first_gap_ms
    opened = calibration.concurrency or 0
    ttft = [
        t + (first if first is not None and i < opened else offset)
        for t, i in zip(run.ttft_ms, run.ttft_request, strict=True)
    ]
    rows = []
    for metric, (section, q) in FIDELITY_METRICS.items():
        measured = (result.get(section) or {}).get(f"p{q:g}")
        values = ttft if section == "ttft_ms" else run.itl_ms
        if measured is None or not values:
            continue
        rows.append(FidelityRow(metric, float(measured), percentile(values, q)))
    return rows


def replay_recorded(
    model_dir: str, result: dict[str, Any], profile: StepProfile | None = None
) -> list[FidelityRow] | None:
    """Calibrate on a recorded kvflow bench result alone (the settings it recorded, the model's
    config.json, the step profile measured when it was recorded if given; no server, no torch) and
    compare; None when it cannot be calibrated (not a kvflow run, no step times)."""
    model = ModelSpec.from_dir(model_dir)
    settings = settings_from_result(result)
    calibration = calibrate(evidence_from_bench(result), settings, model, settings.kv_cache_dtype, profile)
    return None if calibration is None else fidelity(calibration, result)
