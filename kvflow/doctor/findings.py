"""The six checks of the diagnosis (the "steps" of docs/doctor.md), in the troubleshooting order, and
the ranking of the causes they name. Each `check_<id>` (kvflow/doctor/check_*.py) returns one
Finding with its evidence, its causes, and what-ifs with predicted effects (docs/doctor.md has every
formula). They are checks, not "steps", in the code: kvflow's engine has steps too.

The findings keep the troubleshooting order (input, TTFT, ITL, KV, quantization, features); the
causes of their warnings are also ranked across checks by the latency they explain per request, so
the report can say first what costs the most.
"""

from __future__ import annotations

from kvflow.doctor.check_features import check_serving_features
from kvflow.doctor.check_input import check_input_length
from kvflow.doctor.check_itl import check_itl
from kvflow.doctor.check_kv import check_kv_memory
from kvflow.doctor.check_quant import check_quantization
from kvflow.doctor.check_ttft import check_ttft
from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import Cause, Finding, WhatIf
from kvflow.doctor.noise import hold_back_noise

__all__ = ["CHECKS", "Cause", "Diagnosis", "Finding", "WhatIf", "diagnose", "rank_causes"]

CHECKS = (
    check_input_length,
    check_ttft,
    check_itl,
    check_kv_memory,
    check_quantization,
    check_serving_features,
)


def diagnose(d: Diagnosis) -> list[Finding]:
    """Every check's finding, in the troubleshooting order; on a measured run, each latency
    prediction with the run's noise, and the what-ifs inside it held back (kvflow/doctor/noise.py)."""
    findings = [check(d) for check in CHECKS]
    if d.measured:
        hold_back_noise(d.run, findings)
    return findings


def rank_causes(findings: list[Finding]) -> list[tuple[Finding, Cause]]:
    """The causes of every warning, most latency explained first; one per setting (two checks that
    blame the same setting, e.g. preemptions in ITL and in KV memory, are one cause), earlier checks
    first on ties (the troubleshooting order)."""
    best: dict[str, tuple[Finding, Cause]] = {}
    for finding in findings:
        if finding.severity != "warning":
            continue
        for cause in finding.causes:
            key = cause.setting or cause.id
            if key not in best or cause.explained_ms > best[key][1].explained_ms:
                best[key] = (finding, cause)
    return sorted(best.values(), key=lambda fc: (-fc[1].explained_ms, fc[0].step))
