"""`kvflow doctor` flags -> model, hardware, settings, evidence -> findings -> text / JSON / HTML."""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvflow.assets import bundled_model_dir
from kvflow.bench.gauges import GaugeSamples
from kvflow.bench.server_metrics import scrape
from kvflow.bench.server_view import server_section
from kvflow.doctor.bench_request import bench_story
from kvflow.doctor.evidence import RunEvidence, calculator_evidence, evidence_from_bench
from kvflow.doctor.findings import Diagnosis, diagnose
from kvflow.doctor.hardware import NAMED, named_hardware
from kvflow.doctor.model_spec import DTYPE_BYTES, ModelSpec, default_kv_dtype
from kvflow.doctor.quant_served import load_served_tpot, measure_served_tpot
from kvflow.doctor.quant_speed import QUANT_FORMATS, load_speeds, measure_speeds
from kvflow.doctor.repeated_runs import mismatch, predict_over_runs, rediagnosis
from kvflow.doctor.replicas import replicas_report, replicas_text
from kvflow.doctor.report import doctor_json, html_report, text_report
from kvflow.doctor.roofline import Roofline
from kvflow.doctor.server_settings import EngineSettings, settings_from_metrics, settings_from_result
from kvflow.doctor.step_profile import StepProfile, load_profile, measure_profile
from kvflow.errors import KVFlowError

DEFAULT_CONTEXT = 2048
DEFAULT_OUTPUT_LEN = 256
# --verify: pairs per what-if; three state a spread (max - min over the baseline repeats).
VERIFY_REPEATS = 3


def add_doctor_parser(sub: Any) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="diagnose latency: input, TTFT, ITL, KV memory, quantization, serving features",
        description="The six-step latency diagnosis from a kvflow bench result and a model's config.json.",
    )
    doctor.add_argument(
        "model",
        nargs="?",
        help="checkpoint directory (config.json alone is enough without --verify); default: bundled model",
    )
    _add_sources(doctor)
    _add_calculator(doctor)
    _add_outputs(doctor)
    doctor.set_defaults(func=cmd_doctor)


def _add_sources(parser: argparse.ArgumentParser) -> None:
    """Where the doctor's measurements and settings come from."""
    parser.add_argument(
        "--hardware",
        type=str.lower,  # named_hardware's names are case-insensitive: H100 is h100
        choices=("auto", "cpu", *sorted(NAMED)),
        default="auto",
        help="the roofline's hardware: a datasheet entry, or auto/cpu to measure this machine",
    )
    parser.add_argument("--bench", default=None, help="a kvflow bench JSON result to diagnose")
    parser.add_argument(
        "--bench-repeat",
        action="append",
        default=[],
        metavar="PATH",
        help="another run of the --bench benchmark against the same server (repeatable): each what-if "
        "is predicted again from each run and stated with the median and range over all of them (one "
        "run is one draw of the steps the simulator is fitted to)",
    )
    parser.add_argument(
        "--request",
        default=None,
        metavar="ID",
        help="explain one request: where its TTFT and slowest gaps went. Of a running kvflow server "
        "(--server; ID as the dashboard's Gantt row shows it, or its x-request-id), or of a kvflow "
        "bench result (--bench; ID its index in the result's requests); or `slowest`",
    )
    parser.add_argument(
        "--server", default="http://127.0.0.1:8000", help="--request: the kvflow server's base URL"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="--request: the server's API key, when it has one (sent as 'Authorization: Bearer KEY')",
    )
    parser.add_argument("--engine-config", default=None, help="JSON of the server's settings")
    parser.add_argument(
        "--metrics-url", default=None, help="the server's /metrics (kvflow: settings from it)"
    )
    parser.add_argument(
        "--replica-metrics",
        nargs="+",
        default=(),
        metavar="URL",
        help="replicas behind a router: read each one's /metrics now (since it started) into one report; "
        "a --bench result made with kvflow bench --replica-metrics carries its own",
    )


def _add_calculator(parser: argparse.ArgumentParser) -> None:
    """The calculator's workload and formats (when there is no bench result to read them from)."""
    parser.add_argument(
        "--context", type=int, default=None, help=f"calculator mode: prompt tokens; unset: {DEFAULT_CONTEXT}"
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help=f"calculator mode: output tokens; unset: {DEFAULT_OUTPUT_LEN}",
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="calculator mode: requests in flight; unset: 1"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=sorted(DTYPE_BYTES),
        help="KV storage; unset: the server's setting, else the weight dtype",
    )
    parser.add_argument(
        "--weight-dtype",
        default=None,
        choices=sorted(DTYPE_BYTES),
        help="weight storage; unset: the server's dtype, else config.json's",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="calculator: also predict per-rank memory, all-reduce bytes per token and the decode "
        "roofline per rank with the model sharded over N ranks (the hardware figures are one rank's)",
    )


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    """What the doctor writes and whether it measures what-ifs."""
    parser.add_argument("--json", action="store_true", help="print the JSON document instead of text")
    parser.add_argument("--output", default=None, help="also write the JSON document here")
    parser.add_argument("--html", default=None, help="write an HTML report here")
    parser.add_argument("--verify", action="store_true", help="kvflow only: apply and measure each what-if")
    parser.add_argument(
        "--verify-repeats",
        type=int,
        default=VERIFY_REPEATS,
        help="--verify: benchmark pairs (baseline, change) per what-if, medians; 3 or more state the "
        "baseline's spread, against which a change within noise is told apart",
    )
    parser.add_argument(
        "--profile-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="kvflow only: the simulator's step costs from the engine's step times measured here over "
        "prompt lengths, batch sizes and contexts (kvflow profile-steps, cached per model and machine) "
        "instead of a line through the run's step means. Default: on when the server ran on this "
        "machine (a loopback URL, or --verify) and MODEL holds the weights",
    )
    parser.add_argument(
        "--measure-quantization",
        action="store_true",
        help="measure int8/int4 decode speed with kvflow quant-eval and served to one client (cached per "
        "model and machine)",
    )


def _settings(args: argparse.Namespace, result: dict[str, Any] | None) -> EngineSettings:
    if args.engine_config:
        return EngineSettings.from_json(args.engine_config)
    url = args.metrics_url
    if url is None and result is not None:  # the benchmarked server, if it is still there
        url = str(result["config"]["base_url"]).rstrip("/").removesuffix("/v1") + "/metrics"
    recorded = settings_from_result(result) if result is not None else EngineSettings()
    if url is None:
        return recorded
    try:
        found = settings_from_metrics(url)
    except Exception:  # the server may be gone: what the result recorded, else unknown
        return recorded
    return found if found.server != "unknown" else recorded


def _has_weights(model: str) -> bool:
    """Whether MODEL is a checkpoint with its weights here (not a config.json alone): what measuring
    it on this machine needs."""
    return (Path(model) / "config.json").is_file() and any(Path(model).glob("*.safetensors"))


ByFormat = dict[str, float]  # a measurement per weight format


def _quant_measurements(args: argparse.Namespace, weight_dtype: str) -> tuple[ByFormat, ByFormat]:
    """(decode tokens/s per weight format from kvflow quant-eval, served TPOT p50 per format), cached,
    measured now on --measure-quantization; empty without the checkpoint's weights."""
    if not _has_weights(args.model):
        return {}, {}
    if args.measure_quantization:
        return (
            measure_speeds(args.model, weight_dtype),
            measure_served_tpot(args.model, weight_dtype, QUANT_FORMATS),
        )
    return load_speeds(args.model, weight_dtype), load_served_tpot(args.model, weight_dtype)


def diagnosis_step_profile(
    args: argparse.Namespace, settings: EngineSettings, dtype: str, result: dict[str, Any]
) -> StepProfile | None:
    """The step profile for the simulator (the cached one, else measured now) when asked for, or by
    default when it describes the diagnosed server: a kvflow server that ran on this machine, with
    the weights here. On the planted benchmark it is the difference between a worst value error of
    66% and 33% (benchmarks/NOTES.md, session 25): a line through one run's step means cannot tell
    a step's fixed cost from its per-token cost when the run had two step shapes."""
    wanted = args.profile_steps
    if wanted is None:
        wanted = args.verify or _runs_here(str(result.get("config", {}).get("base_url") or ""))
    if not wanted or settings.server != "kvflow" or not _has_weights(args.model):
        return None
    cached = load_profile(args.model, dtype, settings.quantization)
    return cached or measure_profile(args.model, dtype, settings.quantization, settings.max_model_len)


def _runs_here(url: str) -> bool:
    """Whether `url` names this machine (a loopback address): its steps are this machine's."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified  # 0.0.0.0: a client reaches this machine


def read_bench_result(path: str, flag: str = "--bench") -> dict[str, Any]:
    """A `kvflow bench --output` file, or a KVFlowError naming what is wrong with it (a missing file
    or one that is not a bench result gets a message, not a traceback); `flag`: the option it came in."""
    try:
        result = json.loads(Path(path).read_text())
    except OSError as exc:
        raise KVFlowError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise KVFlowError(f"{flag} {path}: not JSON ({exc}); give a `kvflow bench --output` file") from exc
    if not isinstance(result, dict):
        raise KVFlowError(f"{flag} {path}: not a kvflow bench result; give a `kvflow bench --output` file")
    return result


def served_dtypes(
    model: ModelSpec,
    settings: EngineSettings,
    weight_dtype: str | None = None,
    kv_cache_dtype: str | None = None,
) -> tuple[str, str, str]:
    """(the weights' storage, the unquantized float dtype, the KV cache's dtype) of the diagnosed
    server: what was asked, else what the server reports, else the checkpoint's. Weight-only
    quantization leaves the KV cache in the float dtype."""
    weights = weight_dtype or settings.weight_dtype or model.weight_dtype
    float_dtype = settings.dtype if settings.dtype in DTYPE_BYTES else model.dtype
    kv = kv_cache_dtype or settings.kv_cache_dtype or default_kv_dtype(weights, float_dtype)
    return weights, float_dtype, kv


def build_diagnosis(args: argparse.Namespace) -> tuple[Diagnosis, dict[str, Any] | None]:
    if args.model is None:  # as every command: the bundled model when MODEL is omitted
        args.model = str(bundled_model_dir("target"))
    model = ModelSpec.from_dir(args.model)
    result = read_bench_result(args.bench) if args.bench else None
    settings = _settings(args, result)
    run: RunEvidence
    if result is not None:
        run = evidence_from_bench(result)
    else:
        run = calculator_evidence(
            args.context or DEFAULT_CONTEXT, args.concurrency or 1, args.output_len or DEFAULT_OUTPUT_LEN
        )
    weight_dtype, float_dtype, kv_dtype = served_dtypes(
        model, settings, args.weight_dtype, args.kv_cache_dtype
    )
    roofline = Roofline(model, named_hardware(args.hardware), weight_dtype, kv_dtype)
    speeds, served_tpot = _quant_measurements(args, float_dtype)
    profile = diagnosis_step_profile(args, settings, float_dtype, result) if result is not None else None
    diagnosis = Diagnosis(
        model,
        roofline,
        run,
        settings,
        measured=result is not None,
        quant_speeds=speeds,
        quant_served_tpot_ms=served_tpot,
        step_profile=profile,
    )
    return diagnosis, result


def cmd_request(args: argparse.Namespace) -> int:
    """`--request ID`: the server's story of one request (kvflow/server/dashboard/request_story.py),
    from a bench result's window (--bench) or the live server's."""
    import httpx

    if args.bench:
        told = bench_story(read_bench_result(args.bench), args.request)
        print(json.dumps(told, indent=1) if args.json else told["summary"])
        return 0

    url = f"{args.server.rstrip('/')}/dashboard/request/{args.request}"
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        response = httpx.get(url, params={"format": "json"}, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ValueError(f"--request: cannot reach {args.server}: {exc}") from exc
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        print(f"kvflow doctor --request: {message} (HTTP {response.status_code})", file=sys.stderr)
        return 1
    story = response.json()
    print(json.dumps(story, indent=1) if args.json else story["summary"])
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per scrape would mix into the report
    if args.request is not None:
        return cmd_request(args)
    diagnosis, result = build_diagnosis(args)
    findings = diagnose(diagnosis)
    if args.bench_repeat:
        if result is None:
            raise ValueError("--bench-repeat: give the diagnosed run with --bench first")
        repeats = []
        for path in args.bench_repeat:
            other = read_bench_result(path, "--bench-repeat")
            differs = mismatch(result, other)
            if differs is not None:
                raise ValueError(f"--bench-repeat {path}: not a repeat of --bench: {differs}")
            repeats.append(other)
        predict_over_runs(findings, rediagnosis(diagnosis), repeats)
    doc = doctor_json(diagnosis, findings)
    tp_text = None
    if args.tensor_parallel_size > 1:
        from kvflow.doctor.tensor_parallel import estimate

        tp = estimate(
            diagnosis.model,
            diagnosis.roofline,
            args.tensor_parallel_size,
            args.concurrency or 1,
            args.context or DEFAULT_CONTEXT,
        )
        doc["tensor_parallel"] = tp.as_dict()
        tp_text = tp.text()
    if args.verify:
        if result is None:
            raise ValueError("--verify re-runs a benchmark: give --bench")
        if diagnosis.settings.server != "kvflow":
            raise ValueError("--verify needs a kvflow server's settings (--metrics-url or --engine-config)")
        from kvflow.doctor.verify import verify

        if args.verify_repeats < 1:
            raise ValueError(f"--verify-repeats must be at least 1, got {args.verify_repeats}")
        checks = verify(
            args.model,
            diagnosis.settings,
            findings,
            result,
            repeats=args.verify_repeats,
            rediagnose=rediagnosis(diagnosis),  # each fresh baseline a repeat
        )
        doc["verification"] = [
            {
                "change": c.change,
                "metric": c.metric,
                "baseline": c.baseline,
                "predicted": c.predicted,
                "measured": c.measured,
                "agrees": c.agrees,
                "value_error": c.value_error,
                "paired_measured": c.paired_measured,
                "paired_value_error": c.paired_value_error,
                "interval": list(c.interval) if c.interval is not None else None,
                "covered": c.covered,
                "measured_range": list(c.measured_range) if c.measured_range is not None else None,
                "inside_measured_range": c.inside_measured_range,
                "carry": c.carry,
                "uncarried_value_error": c.uncarried_value_error,
                "repeated_predictions": list(c.repeated),
                "repeated_predicted": c.repeated_predicted,
                "repeated_value_error": c.repeated_value_error,
                "inside_repeated_range": c.inside_repeated_range,
                "noise": c.noise,
                "verdict": c.verdict,
                "explanation": c.explain(),
            }
            for c in checks
        ]
    replicas = _replicas(args, result)
    if replicas is not None:
        doc["replicas"] = replicas
    if args.output:
        Path(args.output).write_text(json.dumps(doc, indent=1))
    if args.html:
        Path(args.html).write_text(html_report(doc))
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(text_report(doc))
        if tp_text is not None:
            print(tp_text)
        for check in doc.get("verification", []):
            print("verify: " + check["explanation"], file=sys.stdout)
        if replicas is not None:
            print(replicas_text(replicas))
    return 0


def _replicas(args: argparse.Namespace, result: dict[str, Any] | None) -> dict[str, Any] | None:
    """The replicas report: scraped now (--replica-metrics), else the bench result's, else None."""
    if args.replica_metrics:
        sections = []
        for url in args.replica_metrics:
            now = scrape(url)
            if now is None:
                raise ValueError(f"--replica-metrics {url}: no Prometheus /metrics there")
            gauges = GaugeSamples()
            gauges.add(now)
            sections.append({"metrics_url": url, **server_section({}, now, None, gauges)})
        return replicas_report(sections, cumulative=True)
    if result is not None and result.get("replicas"):
        return replicas_report(result["replicas"], cumulative=False)
    return None
