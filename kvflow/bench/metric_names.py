"""Which `/metrics` names carry each number of kvflow bench's server view, server by server.

kvflow mirrors vLLM's names under its own prefix; SGLang and llama.cpp's llama-server name and count
things their own way. Each field below is the same quantity on every server that has it (docs/metrics.md
has this table); a server without a source for a field is listed as not exporting it, rather than the
field silently reading as zero.

A source is a tuple of alternatives, tried in order (newer names first); an alternative is a tuple of
full sample names whose values add up (llama-server counts prompt tokens without the cached ones and
the cached ones apart: all prompt tokens are their sum).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

Source = tuple[tuple[str, ...], ...]

# Counters, read as deltas over the run.
COUNTER_FIELDS = (
    "prompt_tokens",  # prompt tokens of the run's requests, cached ones included
    "prefix_cache_queries",  # prompt tokens looked up in the prefix cache
    "prefix_cache_hits",  # prompt tokens served from it
    "generation_tokens",
    "num_preemptions",  # requests whose KV was freed to be recomputed later (SGLang: retractions)
    "requests_finished",
    "computed_tokens",  # tokens every engine step computed together (recomputes included)
    "num_steps",  # engine steps (forward passes)
    "prompt_seconds",  # llama-server: each slot's prompt time, summed over slots (they overlap)
    "decode_seconds",  # llama-server: each slot's generation time, summed over slots
)
# Histograms (base names), read as bucket deltas over the run.
HISTOGRAM_FIELDS = ("ttft", "itl", "e2e", "queue_time", "prefill_time")
# Gauges, sampled during the run (kvflow/bench/gauges.py).
GAUGE_FIELDS = ("running", "waiting", "kv_usage", "kv_pool_tokens", "max_running", "max_prefill_tokens")


@dataclass(frozen=True)
class ServerNames:
    family: str  # what the result's `server.server` says
    prefix: str
    counters: dict[str, Source] = field(default_factory=dict)
    histograms: dict[str, Source] = field(default_factory=dict)
    gauges: dict[str, Source] = field(default_factory=dict)
    step_kinds: bool = False  # kvflow's engine_step_time_seconds{step_kind}

    def exported(self) -> set[str]:
        return set(self.counters) | set(self.histograms) | set(self.gauges)


def _one(*names: str) -> Source:
    """Alternatives of single names (newer first)."""
    return tuple((name,) for name in names)


def _vllm_like(
    p: str, family: str, step_kinds: bool, extra_histograms: dict[str, Source] | None = None
) -> ServerNames:
    return ServerNames(
        family,
        p,
        counters={
            "prompt_tokens": _one(p + "prompt_tokens_total"),
            "prefix_cache_queries": _one(
                p + "prefix_cache_queries_total", p + "gpu_prefix_cache_queries_total"
            ),
            "prefix_cache_hits": _one(p + "prefix_cache_hits_total", p + "gpu_prefix_cache_hits_total"),
            "generation_tokens": _one(p + "generation_tokens_total"),
            "num_preemptions": _one(p + "num_preemptions_total"),
            "requests_finished": _one(p + "request_success_total"),
            "computed_tokens": _one(p + "iteration_tokens_total_sum"),
            "num_steps": _one(p + "iteration_tokens_total_count"),
        },
        histograms={
            "ttft": _one(p + "time_to_first_token_seconds"),
            "itl": _one(p + "inter_token_latency_seconds", p + "time_per_output_token_seconds"),
            "e2e": _one(p + "e2e_request_latency_seconds"),
            "queue_time": _one(p + "request_queue_time_seconds"),
            "prefill_time": _one(p + "request_prefill_time_seconds"),
            **(extra_histograms or {}),
        },
        gauges={
            "running": _one(p + "num_requests_running"),
            "waiting": _one(p + "num_requests_waiting"),
            "kv_usage": _one(p + "kv_cache_usage_perc", p + "gpu_cache_usage_perc"),
        },
        step_kinds=step_kinds,
    )


_S = "sglang:"
_L = "llamacpp:"
SERVERS: tuple[ServerNames, ...] = (
    _vllm_like(
        "kvflow:",
        "kvflow",
        step_kinds=True,
        # Structured output's wait for a grammar (kvflow only; read when present, never listed as a gap).
        extra_histograms={"grammar_compile": _one("kvflow:grammar_compile_time_seconds")},
    ),
    _vllm_like("vllm:", "vllm", step_kinds=False),
    ServerNames(
        "sglang",
        _S,
        counters={
            "prompt_tokens": _one(_S + "prompt_tokens_total"),
            "prefix_cache_queries": _one(_S + "prompt_tokens_total"),
            "prefix_cache_hits": _one(_S + "cached_tokens_total"),
            "generation_tokens": _one(_S + "generation_tokens_total"),
            "num_preemptions": _one(_S + "num_retracted_requests_total"),
            "requests_finished": _one(_S + "num_requests_total"),
        },
        histograms={
            "ttft": _one(_S + "time_to_first_token_seconds"),
            "itl": _one(_S + "inter_token_latency_seconds", _S + "time_per_output_token_seconds"),
            "e2e": _one(_S + "e2e_request_latency_seconds"),
            "queue_time": _one(_S + "queue_time_seconds"),
        },
        gauges={
            "running": _one(_S + "num_running_reqs"),
            "waiting": _one(_S + "num_queue_reqs"),
            "kv_usage": _one(_S + "token_usage"),
            "kv_pool_tokens": _one(_S + "max_total_num_tokens"),
            "max_running": _one(_S + "max_running_requests"),
            "max_prefill_tokens": _one(_S + "max_prefill_tokens"),
        },
    ),
    ServerNames(
        "llama.cpp",
        _L,
        counters={
            # llama-server counts prompt tokens without the cached ones, and the cached ones apart.
            "prompt_tokens": ((_L + "prompt_tokens_total", _L + "prompt_tokens_cached_total"),),
            "prefix_cache_queries": ((_L + "prompt_tokens_total", _L + "prompt_tokens_cached_total"),),
            "prefix_cache_hits": _one(_L + "prompt_tokens_cached_total"),
            "generation_tokens": _one(_L + "tokens_predicted_total"),
            "num_steps": _one(_L + "n_decode_total"),
            "prompt_seconds": _one(_L + "prompt_seconds_total"),
            "decode_seconds": _one(_L + "tokens_predicted_seconds_total"),
        },
        gauges={
            "running": _one(_L + "requests_processing"),
            "waiting": _one(_L + "requests_deferred"),
            "kv_usage": _one(_L + "kv_cache_usage_ratio"),  # older builds only
        },
    ),
)

# The fields of the server view a reader looks for; those a server lacks are listed as not exported
# (the llama-server-only seconds and SGLang's configuration gauges are extras, not gaps).
REPORTED_FIELDS = (
    "prompt_tokens",
    "prefix_cache_hits",
    "generation_tokens",
    "num_preemptions",
    "requests_finished",
    "num_steps",
    *HISTOGRAM_FIELDS,
    "running",
    "waiting",
    "kv_usage",
)


def server_names(sample_names: Iterable[str]) -> ServerNames | None:
    """The naming scheme of the server whose samples these are (the first prefix present)."""
    present = list(sample_names)
    for names in SERVERS:
        if any(name.startswith(names.prefix) for name in present):
            return names
    return None
