"""The measured side of the diagnosis: numbers taken from a `kvflow bench` result and from the
server's settings (kvflow's `cache_config_info` metric, or an engine-config JSON), or, in calculator
mode, from `--context` / `--concurrency` alone."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.bench.metrics import percentile
from kvflow.bench.server_metrics import scrape

ENGINE_INFO_METRICS = ("kvflow:cache_config_info", "vllm:cache_config_info")


@dataclass
class EngineSettings:
    """What the server does; None = unknown (the finding then says so instead of guessing)."""

    server: str = "unknown"  # "kvflow", "vllm" or "unknown"
    enable_prefix_caching: bool | None = None
    max_num_batched_tokens: int | None = None  # the chunked-prefill chunk (token budget per step)
    max_num_seqs: int | None = None
    num_kv_blocks: int | None = None
    block_size: int | None = None
    kv_cache_dtype: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    continuous_batching: bool | None = None
    speculative_decoding: bool | None = None

    @property
    def kv_pool_tokens(self) -> int | None:
        if self.num_kv_blocks is None or self.block_size is None:
            return None
        return self.num_kv_blocks * self.block_size

    @classmethod
    def from_labels(cls, labels: dict[str, str], server: str) -> EngineSettings:
        def num(key: str) -> int | None:
            value = labels.get(key)
            return int(value) if value not in (None, "", "None") else None

        caching = labels.get("enable_prefix_caching")
        return cls(
            server=server,
            enable_prefix_caching=None if caching is None else caching.lower() == "true",
            max_num_batched_tokens=num("max_num_batched_tokens"),
            max_num_seqs=num("max_num_seqs"),
            num_kv_blocks=num("num_kv_blocks") or num("num_gpu_blocks"),
            block_size=num("block_size"),
            kv_cache_dtype=labels.get("kv_cache_dtype") or labels.get("cache_dtype"),
            dtype=labels.get("dtype"),
            max_model_len=num("max_model_len"),
            continuous_batching=True if server in ("kvflow", "vllm") else None,
            speculative_decoding=(labels.get("speculative_method", "none") != "none")
            if server == "kvflow"
            else None,
        )

    @classmethod
    def from_json(cls, path: str) -> EngineSettings:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        return cls.from_labels({k: str(v) for k, v in data.items()}, str(data.get("server", "unknown")))


def settings_from_metrics(metrics_url: str) -> EngineSettings:
    """Read the engine configuration a kvflow (or vLLM) server exports on /metrics: the labels of its
    `cache_config_info` sample; unknown settings when the server has no /metrics or no such sample."""
    snapshot = scrape(metrics_url) or {}
    for name in ENGINE_INFO_METRICS:
        for labels in snapshot.get(name, {}):
            return EngineSettings.from_labels(dict(labels), server=name.split(":")[0])
    return EngineSettings()


@dataclass
class RunEvidence:
    """Numbers from one benchmark run (client side, plus the server's /metrics deltas)."""

    num_requests: int
    concurrency: float  # closed-loop concurrency, or requests in flight estimated by Little's law
    prompt_p50: float
    prompt_p95: float
    output_p50: float
    output_p95: float
    shared_prefix_share: float | None  # repeated leading prompt tokens / prompt tokens
    shared_prefix_p50: float | None  # repeated leading tokens per request (p50)
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    output_throughput: float
    server: dict[str, Any] = field(default_factory=dict)
    languages: dict[str, dict[str, float]] = field(default_factory=dict)
    endpoint: str = "completions"
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def request_len_p95(self) -> float:
        return self.prompt_p95 + self.output_p95

    @property
    def decode_context(self) -> float:
        """Mean context of a decode step: the prompt plus half the output, at the median request."""
        return self.prompt_p50 + self.output_p50 / 2

    @property
    def queue_ms(self) -> float | None:
        return (self.server.get("queue_time_ms") or {}).get("mean")

    @property
    def prefill_ms(self) -> float | None:
        return (self.server.get("prefill_time_ms") or {}).get("mean")

    def step_time_ms(self, kind: str) -> float | None:
        """The server's mean engine step time over the run, for one kind of step (decode_only, mixed,
        prefill_only); None when the server does not export it (only kvflow does)."""
        return ((self.server.get("step_time_ms") or {}).get(kind) or {}).get("mean")

    @property
    def preemptions(self) -> float | None:
        value = self.server.get("num_preemptions")
        return None if value is None else float(value)

    @property
    def prefix_hit_rate(self) -> float | None:
        value = self.server.get("prefix_cache_hit_rate")
        return None if value is None else float(value)


def _p(values: list[float], q: float) -> float:
    return percentile(values, q) if values else 0.0


def evidence_from_bench(result: dict[str, Any]) -> RunEvidence:
    ok = [r for r in result["requests"] if r.get("error") is None]
    if not ok:
        raise ValueError("the benchmark result has no successful request to diagnose")
    prompts = [float(r["prompt_tokens"]) for r in ok]
    outputs = [float(r["output_tokens"]) for r in ok]
    shared = [r.get("shared_prefix_tokens") for r in ok]
    known = [float(s) for s in shared if s is not None]
    share = sum(known) / max(sum(prompts), 1.0) if len(known) == len(ok) else None
    config = result.get("config", {})
    tpot = result["tpot_ms"]["p50"]
    concurrency = config.get("concurrency")
    if concurrency is None and tpot:  # open loop: Little's law, tokens/s x s/token = streams in flight
        concurrency = result["output_throughput"] * tpot / 1e3
    return RunEvidence(
        num_requests=len(ok),
        concurrency=float(concurrency or 1.0),
        prompt_p50=_p(prompts, 50),
        prompt_p95=_p(prompts, 95),
        output_p50=_p(outputs, 50),
        output_p95=_p(outputs, 95),
        shared_prefix_share=share,
        shared_prefix_p50=_p(known, 50) if share is not None else None,
        ttft_p50_ms=result["ttft_ms"]["p50"],
        ttft_p95_ms=result["ttft_ms"]["p95"],
        tpot_p50_ms=tpot,
        itl_p50_ms=result["itl_ms"]["p50"],
        itl_p99_ms=result["itl_ms"]["p99"],
        output_throughput=float(result["output_throughput"]),
        server=result.get("server") or {},
        languages=result.get("languages") or {},
        endpoint=str(config.get("endpoint", "completions")),
        config=config,
    )


def calculator_evidence(context: int, concurrency: int, output_len: int) -> RunEvidence:
    """No benchmark: a planned workload of `context` prompt tokens and `output_len` output tokens."""
    return RunEvidence(
        num_requests=0,
        concurrency=float(concurrency),
        prompt_p50=float(context),
        prompt_p95=float(context),
        output_p50=float(output_len),
        output_p95=float(output_len),
        shared_prefix_share=None,
        shared_prefix_p50=None,
        ttft_p50_ms=None,
        ttft_p95_ms=None,
        tpot_p50_ms=None,
        itl_p50_ms=None,
        itl_p99_ms=None,
        output_throughput=0.0,
    )
