"""Prometheus metrics with vLLM's names under the `kvflow:` prefix (mapping in docs/metrics.md).

Everything is observed in the engine thread, once per step, from the step's `StepStats` and the
`RequestOutput`s it produced; the values come from each request's timeline (kvflow/stats.py), so
the server, `kvflow bench` and `kvflow doctor` share one definition of TTFT, ITL, queue time, ...
Each server owns its `CollectorRegistry`: no process-global metric state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvflow.outputs import RequestOutput
from kvflow.stats import RequestTimeline, StepStats

PREFIX = "kvflow:"
LABELS = ("model_name",)  # every family's first label: one registry per served model

# Latency buckets (seconds). They start at 1 ms: vLLM's 10 ms floor cannot resolve a small model's
# ITL. Dense from 5 to 100 ms, where CPU decode steps land, so that quantiles interpolated from the
# buckets (Prometheus' histogram_quantile) are within a few ms of the exact values.
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.06,
    0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3,
    0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Tokens per step: vLLM's buckets (powers of two up to 16k).
ITERATION_TOKEN_BUCKETS = tuple(2**i for i in range(15))
STEP_KINDS = ("decode_only", "mixed", "prefill_only")
FINISHED_REASONS = ("stop", "length", "abort")


def _token_count_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return buckets
            buckets.append(value)
        scale *= 10


@dataclass(frozen=True)
class _Families:
    """Declares metric families in one registry: `kvflow:`-prefixed, labelled by model name first."""

    registry: CollectorRegistry

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], extra_labels: tuple[str, ...] = ()
    ) -> Histogram:
        return Histogram(
            PREFIX + name, doc, [*LABELS, *extra_labels], buckets=buckets, registry=self.registry
        )

    def counter(self, name: str, doc: str, extra_labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, [*LABELS, *extra_labels], registry=self.registry)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, LABELS, registry=self.registry)


class EngineMetrics:
    """The server's Prometheus families, declared by the `_declare_*` helpers below in the order
    /metrics lists them; observed from the engine thread (`observe_step`)."""

    # Per request: at its first token, at each token (ITL), at its finish (docs/metrics.md).
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    prompt_tokens_hist: Histogram
    generation_tokens_hist: Histogram
    grammar_compile_time: Histogram  # structured-output requests only, at their first token
    # Per engine step.
    iteration_tokens: Histogram
    step_time: Histogram  # also labelled by step_kind
    num_running: Gauge
    num_waiting: Gauge
    kv_usage: Gauge
    # Running totals.
    prompt_tokens: Counter
    generation_tokens: Counter
    preemptions: Counter
    prefix_queries: Counter
    prefix_hits: Counter
    spec_num_drafts: Counter
    spec_num_draft_tokens: Counter
    spec_num_accepted: Counter
    spec_accepted_per_pos: Counter  # also labelled by draft position
    request_success: Counter  # also labelled by finished_reason

    def __init__(
        self, model_name: str, max_model_len: int, engine_info: dict[str, str] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        families = _Families(self.registry)
        self._declare_request_histograms(families, max_model_len)
        self._declare_step_metrics(families)
        self._declare_counters(families)
        if engine_info:  # vLLM's cache_config_info idiom: constant 1, the configuration in the labels
            info = Gauge(
                PREFIX + "cache_config_info",
                "engine configuration (labels); kvflow doctor reads it",
                sorted(engine_info),
                registry=self.registry,
            )
            info.labels(**engine_info).set(1)
        # Export zeros so that dashboards see every labelled series from the start.
        for reason in FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        for kind in STEP_KINDS:
            self.step_time.labels(model_name, kind)
        # A counter that was never incremented must read 0, not be absent: the doctor tells "no
        # preemptions" (0) from "this server does not say" (absent).
        for counter in (
            self.prompt_tokens,
            self.generation_tokens,
            self.preemptions,
            self.prefix_queries,
            self.prefix_hits,
        ):
            counter.labels(model_name)

    def _declare_request_histograms(self, f: _Families, max_model_len: int) -> None:
        lat = REQUEST_LATENCY_BUCKETS
        tokens = _token_count_buckets(max_model_len)
        self.ttft = f.histogram("time_to_first_token_seconds", "first token - arrival", lat)
        self.itl = f.histogram(
            "inter_token_latency_seconds", "gap between consecutive output tokens", ITL_BUCKETS
        )
        self.e2e = f.histogram("e2e_request_latency_seconds", "last token - arrival", lat)
        self.grammar_compile_time = f.histogram(
            "grammar_compile_time_seconds",
            "structured output: arrival - grammar ready (compile off the engine thread, or cache hit)",
            lat,
        )
        self.queue_time = f.histogram("request_queue_time_seconds", "first scheduled - arrival", lat)
        self.prefill_time = f.histogram("request_prefill_time_seconds", "first token - first scheduled", lat)
        self.decode_time = f.histogram("request_decode_time_seconds", "last token - first token", lat)
        self.prompt_tokens_hist = f.histogram("request_prompt_tokens", "prompt tokens per request", tokens)
        self.generation_tokens_hist = f.histogram(
            "request_generation_tokens", "output tokens per request", tokens
        )

    def _declare_step_metrics(self, f: _Families) -> None:
        self.iteration_tokens = f.histogram(
            "iteration_tokens_total", "tokens computed per engine step", ITERATION_TOKEN_BUCKETS
        )
        self.step_time = f.histogram(
            "engine_step_time_seconds",
            "engine step duration by what the step computed (mixed = prefill chunks + decodes)",
            ITL_BUCKETS,
            ("step_kind",),
        )
        self.num_running = f.gauge("num_requests_running", "requests holding KV blocks")
        self.num_waiting = f.gauge("num_requests_waiting", "requests queued (preempted included)")
        self.kv_usage = f.gauge("kv_cache_usage_perc", "fraction of KV blocks in use (1 = full)")

    def _declare_counters(self, f: _Families) -> None:
        self.prompt_tokens = f.counter(
            "prompt_tokens", "prompt tokens of requests that produced a first token"
        )
        self.generation_tokens = f.counter("generation_tokens", "output tokens generated")
        self.preemptions = f.counter("num_preemptions", "requests preempted (KV recomputed later)")
        self.prefix_queries = f.counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = f.counter("prefix_cache_hits", "prompt tokens served from the prefix cache")
        self.spec_num_drafts = f.counter("spec_decode_num_drafts", "verification steps that carried drafts")
        self.spec_num_draft_tokens = f.counter("spec_decode_num_draft_tokens", "draft tokens proposed")
        self.spec_num_accepted = f.counter("spec_decode_num_accepted_tokens", "draft tokens accepted")
        self.spec_accepted_per_pos = f.counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "draft tokens accepted at each draft position",
            ("position",),
        )
        self.request_success = f.counter(
            "request_success", "finished requests by finish reason", ("finished_reason",)
        )

    def enable_quality_probe(self) -> Callable[[dict[str, float]], None]:
        """Gauges of the online quality probe (kvflow/quality/online_probe.py); returns their updater."""
        m, r = self._model, self.registry
        docs = {
            "mean_kl": ("quality_probe_kl_divergence", "mean KL(reference || served) per position, nats"),
            "top1_agreement": ("quality_probe_top1_agreement", "share of positions with the same argmax"),
            "perplexity_reference": ("quality_probe_perplexity_reference", "unquantized model's perplexity"),
            "perplexity_served": ("quality_probe_perplexity_served", "served (quantized) model's perplexity"),
            "positions": ("quality_probe_positions", "token positions scored so far"),
        }
        gauges = {key: Gauge(PREFIX + name, doc, LABELS, registry=r) for key, (name, doc) in docs.items()}

        def update(snapshot: dict[str, float]) -> None:
            for key, gauge in gauges.items():
                gauge.labels(m).set(snapshot[key])

        return update

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def observe_step(self, stats: StepStats, outputs: list[RequestOutput]) -> None:
        m = self._model
        if stats.kind != "idle":
            self.step_time.labels(m, stats.kind).observe(stats.duration)
            self.iteration_tokens.labels(m).observe(stats.num_tokens)
        self.num_running.labels(m).set(stats.num_running)
        self.num_waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        if stats.num_preemptions:
            self.preemptions.labels(m).inc(stats.num_preemptions)
        if stats.spec is not None:
            self.spec_num_drafts.labels(m).inc(stats.spec.num_drafts)
            self.spec_num_draft_tokens.labels(m).inc(stats.spec.num_draft_tokens)
            self.spec_num_accepted.labels(m).inc(stats.spec.num_accepted_tokens)
            for position, count in enumerate(stats.spec.accepted_per_pos):
                self.spec_accepted_per_pos.labels(m, str(position)).inc(count)
        for output in outputs:
            self._observe_tokens(output)
            if output.finished:
                self._observe_finished(output)

    def _observe_tokens(self, output: RequestOutput) -> None:
        m, t = self._model, output.metrics
        num_new = len(output.delta_token_ids)
        if num_new == 0:
            return
        self.generation_tokens.labels(m).inc(num_new)
        times = t.token_times
        first_new = len(times) - num_new
        if first_new == 0 and t.ttft is not None:  # this step produced the request's first token
            num_prompt = len(output.prompt_token_ids)
            self.ttft.labels(m).observe(t.ttft)
            self.prompt_tokens.labels(m).inc(num_prompt)
            self.prefix_queries.labels(m).inc(num_prompt)
            self.prefix_hits.labels(m).inc(t.num_cached_prompt_tokens)
            if t.grammar_compile_time is not None:
                self.grammar_compile_time.labels(m).observe(t.grammar_compile_time)
        for i in range(max(first_new, 1), len(times)):
            self.itl.labels(m).observe(times[i] - times[i - 1])

    def _observe_finished(self, output: RequestOutput) -> None:
        m, t = self._model, output.metrics
        reason = output.outputs[0].finish_reason or "abort"
        self.request_success.labels(m, reason).inc()
        if reason == "abort":
            return  # latency of an aborted request says more about the client than the server
        self.prompt_tokens_hist.labels(m).observe(len(output.prompt_token_ids))
        self.generation_tokens_hist.labels(m).observe(len(output.outputs[0].token_ids))
        for hist, value in (
            (self.e2e, t.e2e),
            (self.queue_time, t.queue_time),
            (self.prefill_time, t.prefill_time),
            (self.decode_time, t.decode_time),
        ):
            if value is not None:
                hist.labels(m).observe(value)


def timing_fields(
    t: RequestTimeline, num_prompt_tokens: int, num_output_tokens: int
) -> dict[str, float | int | None]:
    """The opt-in `kvflow.timing` object of a response (milliseconds; definitions in kvflow/stats.py)."""

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1e3, 3)

    return {
        "queue_ms": ms(t.queue_time),
        "prefill_ms": ms(t.prefill_time),
        "ttft_ms": ms(t.ttft),
        "decode_ms": ms(t.decode_time),
        "e2e_ms": ms(t.e2e),
        "tpot_ms": ms(t.tpot),
        "prompt_tokens": num_prompt_tokens,
        "cached_prompt_tokens": t.num_cached_prompt_tokens,
        "output_tokens": num_output_tokens,
        "preemptions": t.num_preemptions,
        "grammar_compile_ms": ms(t.grammar_compile_time),
        "restored_prompt_tokens": t.num_restored_tokens,
        "kv_restore_ms": ms(t.kv_restore_time),
    }
