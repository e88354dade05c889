"""Findings on synthetic evidence: the ITL-stall attribution and the queueing split, whose planted
versions need more load than a test machine should carry."""

from __future__ import annotations

import json
from pathlib import Path

from kvflow.doctor.evidence import EngineSettings, RunEvidence
from kvflow.doctor.findings import Diagnosis, Finding, diagnose
from kvflow.doctor.hardware import NAMED
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.roofline import Roofline

CONFIG = json.loads((Path(__file__).parent / "configs" / "llama-3-8b.json").read_text())


def diagnosis(server: dict[str, object], **run: float) -> Diagnosis:
    model = ModelSpec.from_config(CONFIG, "llama-3-8b")
    values = dict(
        num_requests=100, concurrency=16.0, prompt_p50=1000.0, prompt_p95=2000.0, output_p50=200.0,
        output_p95=300.0, shared_prefix_share=0.0, shared_prefix_p50=0.0, ttft_p50_ms=300.0,
        ttft_p95_ms=600.0, tpot_p50_ms=20.0, itl_p50_ms=20.0, itl_p99_ms=30.0, output_throughput=800.0,
    )  # fmt: skip
    values.update(run)
    evidence = RunEvidence(**values, server=server)  # type: ignore[arg-type]
    settings = EngineSettings(
        server="kvflow", enable_prefix_caching=True, max_num_batched_tokens=512, max_num_seqs=64,
        num_kv_blocks=40_000, block_size=16, continuous_batching=True, speculative_decoding=False,
    )  # fmt: skip
    roofline = Roofline(model, NAMED["h100"], "bfloat16", "bfloat16")
    return Diagnosis(model, roofline, evidence, settings, measured=True)


def finding(findings: list[Finding], check_id: str) -> Finding:
    [found] = [f for f in findings if f.id == check_id]
    return found


def test_itl_tail_is_attributed_to_mixed_steps() -> None:
    steps = {"decode_only": {"count": 900, "mean": 18.0}, "mixed": {"count": 100, "mean": 95.0}}
    findings = diagnose(diagnosis({"step_time_ms": steps}, itl_p99_ms=95.0))
    itl = finding(findings, "itl")
    assert itl.severity == "warning" and "prefill chunk" in itl.summary
    [halve] = itl.what_ifs
    assert halve.setting == {"max_num_batched_tokens": 256}
    assert halve.predicted["itl_p99_ms"] == 18.0 + (95.0 - 18.0) / 2


def test_queueing_dominated_ttft() -> None:
    server = {"queue_time_ms": {"mean": 250.0}, "prefill_time_ms": {"mean": 50.0}}
    ttft = finding(diagnose(diagnosis(server)), "ttft")
    assert ttft.severity == "warning" and "queueing" in ttft.summary
    assert any(w.predicted.get("ttft_p50_ms") == 50.0 for w in ttft.what_ifs)


def test_healthy_synthetic_run_has_no_warning() -> None:
    server = {"queue_time_ms": {"mean": 5.0}, "prefill_time_ms": {"mean": 100.0}, "num_preemptions": 0.0}
    assert [f.severity for f in diagnose(diagnosis(server))].count("warning") == 0
