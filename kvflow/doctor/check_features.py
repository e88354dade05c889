"""Step 6: is the serving framework doing its part? Continuous batching, chunked prefill, prefix
caching, speculative decoding: on or off (or unknown, when the server does not say), with the
effect of each that is off."""

from __future__ import annotations

from typing import Any

from kvflow.doctor.check_input import REPEAT_SHARE_WORTH_CACHING
from kvflow.doctor.diagnosis import Diagnosis
from kvflow.doctor.finding import SERVING_FEATURES, Cause, Finding, Severity, WhatIf
from kvflow.doctor.what_ifs import prefix_caching_what_if


def check_serving_features(d: Diagnosis) -> Finding:
    s = d.settings
    evidence: dict[str, Any] = {
        "server": s.server,
        "continuous_batching": s.continuous_batching,
        "chunked_prefill": None if s.max_num_batched_tokens is None else True,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "max_num_seqs": s.max_num_seqs,
        "prefix_caching": s.enable_prefix_caching,
        "speculative_decoding": s.speculative_decoding,
    }
    off, what_ifs = _features_off(d)
    severity: Severity = "info" if off else "ok"
    causes = []
    if s.enable_prefix_caching is False and (d.run.shared_prefix_share or 0.0) >= REPEAT_SHARE_WORTH_CACHING:
        severity = "warning"
        causes.append(_prefix_caching_cause(d, what_ifs))
    unknown = [k for k, v in evidence.items() if v is None and k != "server"]
    known = "; ".join(f"{k} {v}" for k, v in evidence.items() if v is not None and k != "server")
    summary = f"off: {', '.join(off)}" if off else "every feature that matters here is on"
    if s.server == "unknown":
        summary = "the server's settings are unknown (give --metrics-url or --engine-config)"
        severity = "info"
    elif unknown:
        summary += f" ({s.server} does not report: {', '.join(unknown)})"
    return SERVING_FEATURES.answer(
        severity, summary, known or "no settings known", evidence, what_ifs, causes
    )


def _features_off(d: Diagnosis) -> tuple[list[str], list[WhatIf]]:
    """The features known to be off, and the what-if of turning each on (prefix caching first)."""
    s = d.settings
    off: list[str] = []
    what_ifs: list[WhatIf] = []
    if s.enable_prefix_caching is False:
        off.append("prefix caching")
        cache = prefix_caching_what_if(d)
        what_ifs.append(
            cache
            if cache is not None
            else WhatIf(
                "prefix caching on",
                "no repeated prefix was measured: little effect on this workload",
                {},
                {"enable_prefix_caching": True} if s.server == "kvflow" else None,
            )
        )
    if s.speculative_decoding is False:
        off.append("speculative decoding")
        what_ifs.append(
            WhatIf(
                "speculative decoding",
                "not predicted: the gain is (1 - a^(k+1)) / (1 - a) tokens per step at acceptance a, which "
                "must be measured on this workload: kvflow serve --speculative-method ngram|draft reports "
                "it (kvflow:spec_decode_*) and --speculative-auto-disable turns it off where it costs time",
            )
        )
    if s.continuous_batching is False:
        off.append("continuous batching")
    return off, what_ifs


def _prefix_caching_cause(d: Diagnosis, what_ifs: list[WhatIf]) -> Cause:
    """Prefix caching off on a workload that repeats prefixes: the TTFT its what-if saves."""
    saved = 0.0
    if what_ifs and what_ifs[0].predicted.get("ttft_p50_ms") is not None and d.run.ttft_p50_ms:
        saved = d.run.ttft_p50_ms - what_ifs[0].predicted["ttft_p50_ms"]
    return Cause(
        "prefix_caching_off",
        saved,
        "prefix caching is off on a workload that repeats prefixes",
        "enable_prefix_caching",
    )
