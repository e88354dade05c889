"""The doctor's output: a stable JSON document (schema in docs/doctor.md), its text rendering, and
a self-contained HTML page."""

from __future__ import annotations

import html
from dataclasses import asdict
from typing import Any

from kvflow.assets import shared_css
from kvflow.doctor.findings import Diagnosis, Finding, rank_causes
from kvflow.doctor.kv_by_kind import kv_section, split_phrase
from kvflow.doctor.repeated_runs import over_runs

SEVERITY_MARK = {"ok": "ok", "info": "info", "warning": "WARNING"}


def doctor_json(d: Diagnosis, findings: list[Finding]) -> dict[str, Any]:
    """The JSON document; its field names are stable (docs/doctor.md lists them)."""
    return {
        "model": _model_json(d),
        "hardware": _hardware_json(d),
        "memory": _memory_json(d),
        "kv": _kv_json(d),
        "roofline": _roofline_json(d),
        "measured": _measured_json(d),
        "settings": asdict(d.settings),
        "causes": [{"step": f.step, "finding": f.id, **asdict(c)} for f, c in rank_causes(findings)],
        "findings": [asdict(f) for f in findings],
        # Calculator mode: how many devices and which layouts hold the model (kvflow/doctor/deployment.py).
        "deployment": None if d.measured else d.deployment.as_dict(),
    }


def _model_json(d: Diagnosis) -> dict[str, Any]:
    m, roof = d.model, d.roofline
    return {
        "name": m.name,
        "num_params": m.num_params,
        "num_active_params": m.num_active_params,  # a MoE token's: top_k routed experts of each layer
        "kv_latent": m.arch.kv_latent,  # (kv_lora_rank, qk_rope_head_dim) of latent attention, or None
        "weight_dtype": roof.weight_dtype,
        "weight_bytes": m.weight_bytes(roof.weight_dtype),
        "kv_cache_dtype": roof.kv_dtype,
        "kv_cache_bytes_per_token": m.kv_bytes_per_token(roof.kv_dtype),
        "num_layers": m.arch.num_hidden_layers,
        "num_kv_heads": m.arch.num_key_value_heads,
        "num_q_heads": m.arch.num_attention_heads,
        "head_dim": m.arch.head_dim,
        "tied_embeddings": m.arch.tie_word_embeddings,
        "sliding_window": m.arch.sliding_window,
    }


def _hardware_json(d: Diagnosis) -> dict[str, Any]:
    hw = d.roofline.hardware
    return {
        "name": hw.name,
        "bandwidth_bytes_s": hw.bandwidth_bytes_s,
        "flops": hw.flops,
        "memory_bytes": hw.memory_bytes,
        "source": hw.source,
        "spread": hw.spread,
    }


def _memory_json(d: Diagnosis) -> dict[str, Any]:
    roof, run = d.roofline, d.run
    return {
        "weights_bytes": d.settings.weight_bytes or d.model.weight_bytes(roof.weight_dtype),
        "kv_pool_bytes": d.kv_pool_bytes(),
        "kv_pool_known": d.kv_pool_known,  # False: an estimate, the server does not say
        "request_len_p95": run.request_len_p95,
        "max_concurrency": d.max_concurrency(),  # whole requests of p95 length
    }


def _kv_json(d: Diagnosis) -> dict[str, Any]:
    """The KV a request of p95 length holds, by cache kind (kvflow/doctor/kv_by_kind.py); `summary`:
    the same in words for a model with sliding-window or linear-attention layers, else null."""
    length = max(1, round(d.run.request_len_p95))
    return {**kv_section(d, length), "summary": split_phrase(d, length) or None}


def _roofline_json(d: Diagnosis) -> dict[str, Any]:
    """The roofline at the median prompt (prefill) and at the observed batch and context (decode)."""
    roof, run = d.roofline, d.run
    prefill_n = max(1, round(run.prompt_p50))
    prefill = roof.prefill(prefill_n)
    decode = roof.decode_step(d.runnable_batch, round(run.decode_context))
    return {
        "prefill_tokens": prefill_n,
        "prefill_ms_per_token": 1e3 * prefill.seconds / prefill_n,
        "prefill_bound": prefill.bound,
        "decode_batch": d.runnable_batch,
        "decode_context": run.decode_context,
        "decode_ms_per_step": 1e3 * decode.seconds,
        "decode_bound": decode.bound,
    }


def _measured_json(d: Diagnosis) -> dict[str, Any]:
    run = d.run
    return {
        "available": d.measured,
        "prefill_ms_per_token": d.measured_prefill_ms_per_token() if d.measured else None,
        "prefill_ms_per_token_source": d.prefill_slope[1],
        "simulator_fit": d.calibration.fit_report() if d.calibration is not None else None,
        "decode_ms_per_step": run.tpot_p50_ms,
        "ttft_p50_ms": run.ttft_p50_ms,
        "itl_p99_ms": run.itl_p99_ms,
        "concurrency": run.concurrency,
    }


def _num(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _active(m: dict[str, Any]) -> str:
    active = m.get("num_active_params")
    return f", {active / 1e9:.3g}B active" if active and active != m["num_params"] else ""


def text_report(doc: dict[str, Any]) -> str:
    m, r, mem, meas = doc["model"], doc["roofline"], doc["memory"], doc["measured"]
    lines = [
        f"kvflow doctor: {m['name']} ({m['num_params'] / 1e9:.3g}B params{_active(m)}, {m['weight_dtype']} "
        f"{m['weight_bytes'] / 1e9:.3g} GB, KV {m['kv_cache_bytes_per_token']:,.0f} bytes/token) on "
        f"{doc['hardware']['name']}",
        f"  roofline: prefill {r['prefill_ms_per_token']:.4g} ms/token ({r['prefill_bound']}-bound), "
        f"decode {r['decode_ms_per_step']:.4g} ms/step at batch {r['decode_batch']}, "
        f"context {r['decode_context']:,.0f} ({r['decode_bound']}-bound)",
    ]
    if meas["available"]:
        lines.append(
            f"  measured: prefill {_num(meas['prefill_ms_per_token'])} ms/token, decode "
            f"{_num(meas['decode_ms_per_step'])} ms/step"
        )
    estimate = "" if mem["kv_pool_known"] else " (an estimate: the server does not say)"
    lines.append(
        f"  memory: KV pool {mem['kv_pool_bytes'] / 1e9:.3g} GB{estimate} holds {mem['max_concurrency']:,} "
        f"requests of {mem['request_len_p95']:,.0f} tokens"
    )
    deployment = doc.get("deployment") or {}
    if deployment and deployment["min_devices"] != 1:  # calculator mode, more than one device needed
        lines.append("  " + deployment["summary"].replace("\n", "\n  "))
    kv = doc.get("kv") or {}
    if kv.get("summary"):
        lines.append(f"  KV by cache kind: {kv['summary']}")
    if doc["causes"]:
        lines.append("\ncauses, most latency first:")
        for i, c in enumerate(doc["causes"], 1):
            where = f" -> {c['setting']}" if c["setting"] else ""
            ms = f" ({c['explained_ms']:,.1f} ms/request)" if c["explained_ms"] else ""
            lines.append(f"  {i}. [{c['id']}{where}]{ms} {c['summary']}")
    for f in doc["findings"]:
        lines.append(f"\n{f['step']}. {f['title']} [{SEVERITY_MARK[f['severity']]}] {f['summary']}")
        lines.append(f"   cause: {f['cause']}")
        held = f["evidence"].get("what_ifs_within_noise") or []
        shown = {k: v for k, v in f["evidence"].items() if v is not None and k != "what_ifs_within_noise"}
        if shown:
            lines.append("   evidence: " + ", ".join(f"{k}={_num(v)}" for k, v in shown.items()))
        for w in f["what_ifs"]:
            lines.append(f"   what-if {w['change']}: {w['effect']}{_interval_text(w.get('interval') or {})}")
            if w.get("repeated"):
                lines.append("    " + _over_runs_text(w))
        if held:
            changes = "; ".join(w["change"] for w in held)
            lines.append(f"   within this run's noise, not offered: {changes}")
    return "\n".join(lines)


def _over_runs_text(what_if: dict[str, Any]) -> str:
    """ " itl_p99_ms median 47.7 (39.6-59.8) over 4 runs": the prediction over --bench-repeat's
    runs and the diagnosed one (kvflow/doctor/repeated_runs.py); empty without them."""
    spans = [
        f"{metric} median {mid:,.1f} ({lo:,.1f}-{hi:,.1f}) over {n} runs"
        for metric, (mid, lo, hi, n) in over_runs(what_if).items()
    ]
    return " " + "; ".join(spans) if spans else ""


def _interval_text(interval: dict[str, list[float]]) -> str:
    """ " [ttft_p50_ms 52.1-61.3]": each prediction with the run's noise (kvflow/doctor/noise.py)."""
    if not interval:
        return ""
    spans = ", ".join(f"{m} {lo:,.1f}-{hi:,.1f}" for m, (lo, hi) in interval.items())
    return f" [{spans} with the run's noise]"


def html_report(doc: dict[str, Any], note: str = "") -> str:
    """The report as one HTML page in kvflow's look (kvflow/assets/kvflow.css, shared with the live
    dashboard and `kvflow bench --html`); `note`: HTML shown under the title."""
    esc = html.escape
    rows = []
    for f in doc["findings"]:
        evidence = "<br>".join(
            f"{esc(k)} = {esc(_num(v))}" for k, v in f["evidence"].items() if v is not None
        )
        what_ifs = "<br>".join(
            f"<b>{esc(w['change'])}</b>: {esc(w['effect'])}{esc(_over_runs_text(w))}" for w in f["what_ifs"]
        )
        rows.append(
            f"<tr class='{esc(f['severity'])}'><td>{f['step']}</td><td>{esc(f['title'])}</td>"
            f"<td>{esc(f['severity'])}</td><td>{esc(f['summary'])}<br><i>{esc(f['cause'])}</i></td>"
            f"<td>{evidence}</td><td>{what_ifs}</td></tr>"
        )
    summary = esc(text_report(doc).split("\n\n")[0])
    causes = "".join(
        f"<li><b>{esc(c['id'])}</b>{' -> ' + esc(c['setting']) if c['setting'] else ''}: "
        f"{esc(c['summary'])}</li>"
        for c in doc["causes"]
    )
    causes_html = f"<h2>Causes, most latency first</h2><ol>{causes}</ol>" if causes else ""
    note_html = f"<p class='subtitle'>{note}</p>" if note else ""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvflow doctor</title>"
        f"<style>{shared_css()}</style></head>"
        f"<body><h1><span class='brand'>kvflow</span> doctor</h1>{note_html}<pre>{summary}</pre>{causes_html}"
        "<table><tr><th>step</th>"
        "<th>question</th><th>severity</th><th>finding</th><th>evidence</th><th>what-ifs</th></tr>"
        + "".join(rows)
        + "</table></body></html>"
    )
