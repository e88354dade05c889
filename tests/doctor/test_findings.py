"""Findings on synthetic evidence, each built like a case the doctor once got wrong: a preemption
storm blamed on prefill chunks, queueing behind max_num_seqs with no setting named, llama-server
numbers read as kvflow's, a calculator run that does not fit the card, quantization predicted from
bytes far below the roofline, a drifting machine probe flipping the roofline verdict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.doctor.evidence import RequestSample, RunEvidence, calculator_evidence
from kvflow.doctor.findings import Diagnosis, Finding, diagnose, rank_causes
from kvflow.doctor.hardware import NAMED, Hardware
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.roofline import PhaseTime, Roofline
from kvflow.doctor.server_settings import EngineSettings, llamacpp_settings

CONFIGS = Path(__file__).parent / "configs"


def model(name: str) -> ModelSpec:
    return ModelSpec.from_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


def kvflow_settings(**overrides: Any) -> EngineSettings:
    values: dict[str, Any] = dict(
        server="kvflow",
        enable_prefix_caching=True,
        max_num_batched_tokens=512,
        max_num_seqs=64,
        num_kv_blocks=40_000,
        block_size=16,
        continuous_batching=True,
        speculative_decoding=False,
    )
    values.update(overrides)
    return EngineSettings(**values)


def evidence(server: dict[str, Any], **run: Any) -> RunEvidence:
    values: dict[str, Any] = dict(
        num_requests=100,
        concurrency=16.0,
        prompt_p50=1000.0,
        prompt_p95=2000.0,
        output_p50=200.0,
        output_p95=300.0,
        shared_prefix_share=0.0,
        shared_prefix_p50=0.0,
        ttft_p50_ms=300.0,
        ttft_p95_ms=600.0,
        tpot_p50_ms=20.0,
        itl_p50_ms=20.0,
        itl_p99_ms=30.0,
        output_throughput=800.0,
        e2e_p50_ms=4300.0,
    )
    values.update(run)
    return RunEvidence(**values, server=server)


def diagnosis(ev: RunEvidence, settings: EngineSettings, name: str = "llama-3-8b", **kw: Any) -> Diagnosis:
    m = model(name)
    roofline = Roofline(m, kw.pop("hardware", NAMED["h100"]), kw.pop("weight_dtype", "bfloat16"), "bfloat16")
    return Diagnosis(m, roofline, ev, settings, measured=ev.num_requests > 0, **kw)


def finding(findings: list[Finding], check_id: str) -> Finding:
    [found] = [f for f in findings if f.id == check_id]
    return found


def test_a_preemption_storm_is_not_blamed_on_prefill_chunks() -> None:
    # A 40-block pool: 47 preemptions, one step mixed a new prompt with decodes; the long gaps are the
    # recomputes after preemption (the counters say most prefill work was recompute).
    steps = {"decode_only": {"count": 900, "mean": 20.0}, "mixed": {"count": 48, "mean": 60.0}}
    server = {
        "step_time_ms": steps,
        "num_preemptions": 47.0,
        "prompt_tokens": 20 * 100.0,
        "prefix_cache_hits": 0.0,
        "generation_tokens": 20 * 64.0,
        "requests_finished": 20.0,
        "computed_tokens": 20 * 100.0 + 47 * 130.0 + 1200.0,
    }
    gaps = [20.0] * 1200 + [347.0] * 47
    ev = evidence(
        server,
        num_requests=20,
        concurrency=4.0,
        prompt_p50=100.0,
        prompt_p95=100.0,
        output_p50=64.0,
        output_p95=64.0,
        itl_p99_ms=347.0,
        e2e_p50_ms=2000.0,
        ttft_p50_ms=100.0,
        itl_gaps_ms=gaps,
    )
    findings = diagnose(diagnosis(ev, kvflow_settings(num_kv_blocks=40)))
    itl = finding(findings, "itl")
    assert itl.severity == "warning"
    assert itl.causes[0].id == "preemption" and itl.causes[0].setting == "num_kv_blocks"
    assert "prefill chunk" not in itl.cause
    assert rank_causes(findings)[0][1].setting == "num_kv_blocks"


def test_queueing_behind_max_num_seqs_names_the_setting() -> None:
    server = {
        "queue_time_ms": {"mean": 250.0},
        "prefill_time_ms": {"mean": 50.0},
        "gauges": {"running": {"max": 1.0, "mean": 1.0}, "waiting": {"max": 7.0, "mean": 6.0}},
    }
    ev = evidence(server, concurrency=8.0)
    ttft = finding(diagnose(diagnosis(ev, kvflow_settings(max_num_seqs=1))), "ttft")
    assert ttft.severity == "warning" and ttft.causes[0].id == "max_num_seqs"
    assert "max_num_seqs=1" in ttft.summary
    [fix] = [w for w in ttft.what_ifs if w.setting and "max_num_seqs" in w.setting]
    assert fix.setting == {"max_num_seqs": 8}  # what `--verify` applies
    assert fix.predicted["ttft_p50_ms"] == pytest.approx(50.0)  # no simulator here: TTFT minus the queue


def test_healthy_synthetic_run_has_no_warning() -> None:
    server = {"queue_time_ms": {"mean": 5.0}, "prefill_time_ms": {"mean": 100.0}, "num_preemptions": 0.0}
    findings = diagnose(diagnosis(evidence(server), kvflow_settings()))
    assert [f.severity for f in findings].count("warning") == 0 and rank_causes(findings) == []


def llamacpp_run() -> RunEvidence:
    """4 slots, 4 clients sending 256-token prompts together: each TTFT covers all four prefills."""
    requests = [RequestSample(256, 64, 0, 3.5 * (i // 4), 1400.0, 3500.0) for i in range(24)]
    server = {
        "server": "llama.cpp",
        "prefill_time_ms": {"mean": 1380.0},
        "decode_step_ms": 33.0,
        "gauges": {"running": {"max": 4.0}, "waiting": {"max": 0.0}},
        "not_exported": ["ttft", "itl", "queue_time", "num_preemptions", "kv_usage"],
    }
    return evidence(
        server,
        num_requests=24,
        concurrency=4.0,
        prompt_p50=256.0,
        prompt_p95=256.0,
        output_p50=64.0,
        output_p95=64.0,
        ttft_p50_ms=1400.0,
        e2e_p50_ms=3500.0,
        tpot_p50_ms=33.0,
        requests=requests,
    )


def test_llama_server_numbers_are_read_as_llama_server_means_them() -> None:
    meta = {"n_ctx": 2048, "n_params": 494_032_768, "size": 346_206_720, "ftype": "Q4_0"}
    settings = llamacpp_settings(meta, {"total_slots": 4, "model_ftype": "Q4_0"})
    assert (settings.max_num_seqs, settings.kv_pool_tokens, settings.weight_dtype) == (4, 8192, "int4")
    d = diagnosis(llamacpp_run(), settings, "qwen2.5-0.5b", weight_dtype="int4")
    findings = diagnose(d)
    # Four prompts prefilled together in 1.4 s: 1.4 ms per token, not 1400 / 256 = 5.5.
    slope, source = d.prefill_slope
    assert slope == pytest.approx(1400.0 / (4 * 256)) and "batched" in source
    ttft = finding(findings, "ttft")
    assert "queueing unknown" in ttft.summary and "no queueing" not in ttft.summary
    kv = finding(findings, "kv_memory")
    assert kv.evidence["kv_pool_source"] == "the server's" and isinstance(
        kv.evidence["max_concurrency_at_p95"], int
    )
    assert finding(findings, "serving_features").summary != "the server's settings are unknown"


def test_pools_are_read_in_usable_blocks() -> None:
    """kvflow's num_kv_blocks counts the usable blocks (its null block on top); vLLM's num_gpu_blocks
    counts the null block its pool takes out first (vllm/v1/core/block_pool.py)."""
    kvflow = EngineSettings.from_labels({"num_kv_blocks": "12", "block_size": "16"}, "kvflow")
    vllm = EngineSettings.from_labels({"num_gpu_blocks": "12", "block_size": "16"}, "vllm")
    assert (kvflow.num_kv_blocks, kvflow.kv_pool_tokens) == (12, 192)
    assert (vllm.num_kv_blocks, vllm.kv_pool_tokens) == (11, 176)


def test_calculator_says_what_does_not_fit() -> None:
    # Llama-2-13B (4,096 positions) asked for 4,096 + 256 tokens at concurrency 32 on an 80 GB card.
    findings = diagnose(diagnosis(calculator_evidence(4096, 32, 256), EngineSettings(), "llama-2-13b"))
    first = finding(findings, "input_length")
    assert (
        first.severity == "warning" and first.causes[0].id == "context_window" and "exceed" in first.summary
    )
    kv = finding(findings, "kv_memory")
    assert kv.severity == "warning" and kv.causes[0].id == "kv_does_not_fit"
    fits = kv.evidence["max_concurrency_at_p95"]
    assert 0 < fits < 32
    itl = finding(findings, "itl")
    assert itl.evidence["decode_batch"] == fits  # the step time is for what fits, not for 32
    assert not any("sliding window" in w.change for w in kv.what_ifs)  # the model has none


def test_quantization_gain_is_unknown_far_below_the_roofline_unless_measured() -> None:
    # 20 ms per decode step of an 8B model on an H100: a few percent of the bandwidth roofline.
    ev = evidence({"decode_step_ms": 20.0}, concurrency=1.0)
    quant = finding(diagnose(diagnosis(ev, kvflow_settings())), "quantization")
    assert all("unknown" in w.effect and "decode_ms_per_step" not in w.predicted for w in quant.what_ifs)
    speeds = {"bfloat16": 100.0, "int8": 80.0, "int4": 125.0}  # int8 slower, int4 faster, as measured
    quant = finding(diagnose(diagnosis(ev, kvflow_settings(), quant_speeds=speeds)), "quantization")
    predicted = {w.change: w.predicted["decode_ms_per_step"] for w in quant.what_ifs}
    # 10 ms/token for bf16, 12.5 for int8, 8 for int4: the served step moves by the difference.
    assert predicted == {"int8 weights": pytest.approx(22.5), "int4 weights": pytest.approx(18.0)}
    assert {w.setting["quantization"] for w in quant.what_ifs if w.setting} == {"int8", "int4"}


def test_the_formats_served_tpot_predicts_before_quant_evals_speed() -> None:
    """Served, the step is the forward stretched by the API thread and client sharing the cores, plus
    a constant: quant-eval's saving (1.16 ms for int4 on the bundled model) under-predicted the
    served one (1.88), so the formats' served TPOTs, where measured, decide."""
    ev = evidence({"decode_step_ms": 20.0}, concurrency=4.0)
    speeds = {"bfloat16": 100.0, "int8": 80.0, "int4": 125.0}
    served = {"bfloat16": 24.0, "int8": 21.0, "int4": 17.0}
    quant = finding(
        diagnose(diagnosis(ev, kvflow_settings(), quant_speeds=speeds, quant_served_tpot_ms=served)),
        "quantization",
    )
    predicted = {w.change: w.predicted["decode_ms_per_step"] for w in quant.what_ifs}
    # 4 decode rows: the step reads the weights once for all, its saving carries as a difference.
    assert predicted == {"int8 weights": pytest.approx(17.0), "int4 weights": pytest.approx(13.0)}
    assert all("measured served" in w.method for w in quant.what_ifs)
    one_row = evidence({"decode_step_ms": 20.0}, concurrency=1.0)
    quant = finding(
        diagnose(diagnosis(one_row, kvflow_settings(), quant_speeds=speeds, quant_served_tpot_ms=served)),
        "quantization",
    )
    # One row, the probe's own shape: 20 ms x 21/24 and x 17/24.
    assert {w.change: w.predicted["decode_ms_per_step"] for w in quant.what_ifs} == {
        "int8 weights": pytest.approx(17.5),
        "int4 weights": pytest.approx(20.0 * 17.0 / 24.0),
    }
    assert quant.evidence["measured_served_tpot_ms"] == served
    half = finding(  # a format not served: quant-eval's speed for it
        diagnose(
            diagnosis(ev, kvflow_settings(), quant_speeds=speeds, quant_served_tpot_ms={"bfloat16": 24.0})
        ),
        "quantization",
    )
    assert {w.change: w.predicted["decode_ms_per_step"] for w in half.what_ifs} == {
        "int8 weights": pytest.approx(22.5),
        "int4 weights": pytest.approx(18.0),
    }


def test_a_verdict_within_the_probe_spread_is_not_drawn() -> None:
    assert PhaseTime(1.0, 1.0, 0.9, uncertainty=0.0).bound == "compute"
    assert PhaseTime(1.0, 1.0, 0.9, uncertainty=0.25).bound == "either"
    noisy = Hardware("cpu", 20e9, {"bfloat16": 100e9}, 64e9, "probe", spread={"bandwidth_bytes_s": 0.3})
    assert noisy.uncertainty == 0.3
