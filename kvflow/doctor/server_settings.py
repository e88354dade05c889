"""What the diagnosed server is set to, from whatever it tells: kvflow's (and vLLM's)
`cache_config_info` labels on /metrics, llama-server's /props and model card, SGLang's configuration
gauges, or an engine-config JSON. A setting nobody reports stays None: the findings then say it is
unknown instead of guessing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvflow.bench.server_metrics import Snapshot, engine_config, scrape

# llama.cpp's file types -> the weight formats the doctor models (the k-quants are about 4.5 bits).
LLAMACPP_FTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "int8"}
LLAMACPP_KV_DTYPE = "float16"  # llama-server's default -ctk / -ctv


@dataclass
class EngineSettings:
    """What the server does; None = unknown (the finding then says so instead of guessing)."""

    server: str = "unknown"  # "kvflow", "vllm", "sglang", "llama.cpp" or "unknown"
    enable_prefix_caching: bool | None = None
    max_num_batched_tokens: int | None = None  # the chunked-prefill chunk (token budget per step)
    max_num_seqs: int | None = None  # requests running at once (llama-server: its slots)
    num_kv_blocks: int | None = None
    block_size: int | None = None
    kv_cache_dtype: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    continuous_batching: bool | None = None
    speculative_decoding: bool | None = None
    quantization: str | None = None  # weight-only quantization at load: none, int8, int4
    kv_pool_tokens_reported: int | None = None  # a pool reported in tokens (llama-server, SGLang)
    weight_bytes: float | None = None  # the served weights' size when the server says (llama-server)

    @property
    def kv_pool_tokens(self) -> int | None:
        if self.num_kv_blocks is not None and self.block_size is not None:
            return self.num_kv_blocks * self.block_size
        return self.kv_pool_tokens_reported

    @property
    def weight_dtype(self) -> str | None:
        """The weights' storage: the quantized format when there is one, else the dtype."""
        if self.quantization not in (None, "none"):
            return self.quantization
        return self.dtype

    @classmethod
    def from_labels(cls, labels: dict[str, str], server: str) -> EngineSettings:
        def num(key: str) -> int | None:
            value = labels.get(key)
            return int(value) if value not in (None, "", "None") else None

        caching = labels.get("enable_prefix_caching")
        # Usable blocks: kvflow's num_kv_blocks counts them (its null block comes on top); vLLM's
        # num_gpu_blocks counts the null block its pool takes out first (vllm/v1/core/block_pool.py).
        gpu_blocks = num("num_gpu_blocks")
        num_kv_blocks = num("num_kv_blocks")
        if num_kv_blocks is None and gpu_blocks is not None:
            num_kv_blocks = max(gpu_blocks - 1, 0)
        return cls(
            server=server,
            enable_prefix_caching=None if caching is None else caching.lower() == "true",
            max_num_batched_tokens=num("max_num_batched_tokens"),
            max_num_seqs=num("max_num_seqs"),
            num_kv_blocks=num_kv_blocks,
            block_size=num("block_size"),
            kv_cache_dtype=labels.get("kv_cache_dtype") or labels.get("cache_dtype"),
            dtype=labels.get("dtype"),
            max_model_len=num("max_model_len"),
            continuous_batching=True if server in ("kvflow", "vllm") else None,
            speculative_decoding=(labels.get("speculative_method", "none") != "none")
            if server == "kvflow"
            else None,
            quantization=labels.get("quantization"),
        )

    @classmethod
    def from_json(cls, path: str) -> EngineSettings:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        return cls.from_labels({k: str(v) for k, v in data.items()}, str(data.get("server", "unknown")))


def llamacpp_settings(meta: dict[str, Any], props: dict[str, Any]) -> EngineSettings:
    """llama-server: its slots run at once (max_num_seqs); each slot holds n_ctx tokens of KV (the
    model card's `meta.n_ctx` is per slot), so the pool is slots x n_ctx; f16 KV by default;
    continuous batching and per-slot prompt reuse are on by default."""
    slots = props.get("total_slots")
    n_ctx = meta.get("n_ctx")
    ftype = str(props.get("model_ftype") or meta.get("ftype") or "").upper()
    dtype = LLAMACPP_FTYPES.get(ftype, "int4" if ftype.startswith(("Q4", "Q5", "IQ4")) else None)
    return EngineSettings(
        server="llama.cpp",
        enable_prefix_caching=True,  # cache_prompt: a slot reuses the prefix it last processed
        max_num_seqs=int(slots) if slots else None,
        max_model_len=int(n_ctx) if n_ctx else None,
        kv_pool_tokens_reported=int(slots) * int(n_ctx) if slots and n_ctx else None,
        kv_cache_dtype=LLAMACPP_KV_DTYPE,
        dtype=dtype,
        continuous_batching=True,
        weight_bytes=float(meta["size"]) if meta.get("size") else None,
    )


def sglang_settings(snapshot: Snapshot) -> EngineSettings:
    def gauge(name: str) -> int | None:
        values = snapshot.get("sglang:" + name)
        return int(sum(values.values())) if values else None

    return EngineSettings(
        server="sglang",
        max_num_seqs=gauge("max_running_requests"),
        max_num_batched_tokens=gauge("max_prefill_tokens"),
        kv_pool_tokens_reported=gauge("max_total_num_tokens"),
        continuous_batching=True,
    )


def _get_json(url: str) -> dict[str, Any]:
    try:
        response = httpx.get(url, timeout=10)
        data = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def settings_from_metrics(metrics_url: str) -> EngineSettings:
    """The settings the server behind `metrics_url` exports: kvflow's / vLLM's `cache_config_info`
    labels, SGLang's configuration gauges, llama-server's /props and model card (its /metrics has
    none); unknown settings when it tells nothing."""
    snapshot = scrape(metrics_url) or {}
    exported = engine_config(snapshot)
    if exported is not None:
        return EngineSettings.from_labels(exported[1], server=exported[0])
    if any(name.startswith("sglang:") for name in snapshot):
        return sglang_settings(snapshot)
    if any(name.startswith("llamacpp:") for name in snapshot):
        root = metrics_url.rstrip("/").removesuffix("/metrics")
        cards = _get_json(root + "/v1/models").get("data") or [{}]
        return llamacpp_settings(cards[0].get("meta") or {}, _get_json(root + "/props"))
    return EngineSettings()


def settings_from_result(result: dict[str, Any]) -> EngineSettings:
    """What a bench result itself records about the server (kvflow's and vLLM's configuration labels,
    llama-server's model card and /props), for when the server is gone."""
    info = result.get("server_info") or {}
    exported = info.get("engine_config")
    if isinstance(exported, dict) and isinstance(exported.get("labels"), dict):
        labels = {str(k): str(v) for k, v in exported["labels"].items()}
        return EngineSettings.from_labels(labels, str(exported.get("server") or "unknown"))
    if info.get("meta") and info.get("props"):
        return llamacpp_settings(info["meta"], info["props"])
    return EngineSettings()
