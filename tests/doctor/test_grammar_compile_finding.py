"""The doctor's TTFT step names grammar compilation when structured-output requests wait for their
grammar for a real share of TTFT (the wait is queue time, and without this it would be blamed on a
queueing setting), and says nothing about it when the grammars were cached."""

from __future__ import annotations

import pytest
from test_findings import diagnosis, evidence, finding, kvflow_settings

from kvflow.bench.metric_names import REPORTED_FIELDS, server_names
from kvflow.doctor.findings import diagnose


def test_a_large_grammar_wait_is_the_ttft_cause() -> None:
    server = {
        "queue_time_ms": {"mean": 200.0},  # the grammar wait is part of it
        "prefill_time_ms": {"mean": 60.0},
        "grammar_compile_ms": {"mean": 180.0},
        "gauges": {"running": {"max": 4.0, "mean": 3.0}, "waiting": {"max": 2.0, "mean": 1.0}},
    }
    ttft = finding(diagnose(diagnosis(evidence(server, concurrency=4.0), kvflow_settings())), "ttft")
    assert ttft.severity == "warning" and ttft.causes[0].id == "grammar_compile"
    assert "grammar compilation is 60% of TTFT" in ttft.summary
    assert ttft.what_ifs[0].predicted["ttft_p50_ms"] == pytest.approx(120.0)
    assert ttft.evidence["grammar_compile_ms_mean"] == 180.0


def test_cached_grammars_are_not_a_finding() -> None:
    server = {
        "queue_time_ms": {"mean": 5.0},
        "prefill_time_ms": {"mean": 100.0},
        "grammar_compile_ms": {"mean": 0.05},
    }
    ttft = finding(diagnose(diagnosis(evidence(server), kvflow_settings())), "ttft")
    assert all(c.id != "grammar_compile" for c in ttft.causes) and ttft.severity != "warning"


def test_the_histogram_is_read_from_kvflow_only_and_never_a_gap() -> None:
    kvflow = server_names(["kvflow:time_to_first_token_seconds_count"])
    vllm = server_names(["vllm:time_to_first_token_seconds_count"])
    assert kvflow is not None and "grammar_compile" in kvflow.histograms
    assert vllm is not None and "grammar_compile" not in vllm.histograms
    assert "grammar_compile" not in REPORTED_FIELDS
