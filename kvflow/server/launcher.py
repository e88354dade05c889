"""`kvflow serve`: load the model, then run uvicorn with the app and the engine thread.

SIGINT/SIGTERM: new requests get 503 while in-flight ones get `shutdown_grace_s`
(--shutdown-grace-seconds) to finish; the rest are ended with a final chunk (finish_reason abort)
and [DONE]; then the app's lifespan stops the engine thread and the process exits with status 0
(shutdown.py). Connections must send their request head and body within `client_timeout_s`
(connections.py, limits.py) and are at most `max_connections`.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

# ServerConfig lives with the other configs (plain, torch-free) so the CLI builds its flags without
# importing this module; importing it from here keeps working.
from kvflow.config import ConfigError, ServerConfig
from kvflow.engine.async_engine import AsyncLLMEngine, StepObserver
from kvflow.engine.engine import LLMEngine
from kvflow.models.loader import load_model
from kvflow.outputs import RequestOutput
from kvflow.quality.online_probe import QualityProbe
from kvflow.server.api import build_app
from kvflow.server.connections import header_deadline_protocol
from kvflow.server.dashboard.doctor_window import LiveDoctor
from kvflow.server.dashboard.setup import attach_dashboard
from kvflow.server.kv_offload_metrics import register_kv_offload_metrics
from kvflow.server.limits import RequestLimits
from kvflow.server.metrics import EngineMetrics
from kvflow.server.serving import ServingContext
from kvflow.server.shutdown import DrainingServer
from kvflow.stats import StepStats

logger = logging.getLogger(__name__)


def build_context(
    model: str, config: ServerConfig, engine_kwargs: dict[str, Any], live_doctor: LiveDoctor | None = None
) -> ServingContext:
    """Load the model and wire engine, metrics and serving context (the engine thread is not started).
    `live_doctor`: the dashboard's doctor view (the doctor sits above the server; the CLI passes it)."""
    engine = LLMEngine.from_kwargs(model=model, **engine_kwargs)
    if config.chat_template is not None:
        engine.tokenizer.use_chat_template(config.chat_template)
    name = config.served_model_name or model
    metrics = EngineMetrics(name, engine.max_model_len, engine_info(engine))
    if engine.kv_offload_tier is not None:
        register_kv_offload_metrics(metrics.registry, engine.kv_offload_tier, name)
    observer: StepObserver = metrics.observe_step
    if config.quality_probe_rate > 0:
        probe = start_quality_probe(engine, config.quality_probe_rate, metrics)

        def observe(stats: StepStats, outputs: list[RequestOutput]) -> None:
            metrics.observe_step(stats, outputs)
            for output in outputs:
                probe.offer(output)

        observer = observe
    async_engine = AsyncLLMEngine(engine, config.max_waiting, observer)
    dashboard = None
    if config.dashboard:
        dashboard = attach_dashboard(
            async_engine, metrics, name, model, config.dashboard_window_s, live_doctor
        )
    return ServingContext(
        engine=async_engine,
        served_model_name=name,
        model_dir=model,
        max_model_len=engine.max_model_len,
        tokenizer=engine.tokenizer,
        metrics=metrics,
        api_key=config.api_key,
        limits=RequestLimits.from_config(config),
        tool_call_parser=config.tool_call_parser,
        dashboard=dashboard,
    )


def start_quality_probe(engine: LLMEngine, rate: float, metrics: EngineMetrics) -> QualityProbe:
    """Load the unquantized weights beside the served ones and start the probe thread."""
    quant, cache = engine.config.quant_config, engine.config.cache_config
    kv_dtype = cache.kv_cache_dtype
    if engine.parallel is not None:  # the probe would run the sharded model outside the ranks' steps
        raise ConfigError("--quality-probe-rate is not supported with tensor_parallel_size > 1 yet")
    if not quant.enabled and kv_dtype in ("auto", "bfloat16", "float16"):
        raise ConfigError(
            "--quality-probe-rate needs --quantization or a quantized --kv-cache-dtype to probe"
        )
    model_dir = Path(engine.config.model_config.model).expanduser()
    reference = load_model(model_dir, engine.arch, engine.dtype, engine.max_model_len)
    logger.info("quality probe: scoring %.0f%% of finished requests against unquantized weights", 100 * rate)
    return QualityProbe(
        engine.model_runner.model, reference, kv_dtype, rate, metrics.enable_quality_probe(), seed=0
    )


def engine_info(engine: LLMEngine) -> dict[str, str]:
    """The settings `kvflow doctor` needs, exported as labels of kvflow:cache_config_info."""
    cache, sched = engine.config.cache_config, engine.config.scheduler_config
    dtype = str(engine.dtype).removeprefix("torch.")
    return {
        "block_size": str(cache.block_size),
        "enable_prefix_caching": str(cache.enable_prefix_caching).lower(),
        "num_kv_blocks": str(engine.num_kv_blocks),
        "kv_bytes_per_token": str(engine.kv_bytes_per_token),
        # Cache kinds (kvflow/kv_cache/): "kind:layers" per kind, e.g. sliding_attention:12,full_attention:12;
        # a block's bytes over every layer slot.
        "kv_cache_kinds": ",".join(f"{k}:{n}" for k, n in engine.kv_cache_config.layers_by_kind().items()),
        "kv_bytes_per_block": str(engine.kv_cache_config.bytes_per_block),
        "kv_cache_dtype": dtype if cache.kv_cache_dtype == "auto" else cache.kv_cache_dtype,
        "dtype": dtype,
        "max_num_seqs": str(sched.max_num_seqs),
        "max_num_batched_tokens": str(sched.max_num_batched_tokens),
        "max_model_len": str(engine.max_model_len),
        "speculative_method": engine.config.speculative_config.speculative_method,
        "quantization": engine.config.quant_config.quantization,
    }


def make_server(ctx: ServingContext, config: ServerConfig, port: int | None = None) -> DrainingServer:
    """The uvicorn server of `kvflow serve` (and of the tests' live servers) for this context."""
    uv_config = uvicorn.Config(
        build_app(ctx),
        host=config.host,
        port=config.port if port is None else port,
        http=header_deadline_protocol(config.client_timeout_s),
        limit_concurrency=config.max_connections,
        # The drain (shutdown.py) has ended every request before uvicorn's own shutdown starts.
        timeout_graceful_shutdown=1,
        log_level=config.log_level.lower(),
        access_log=False,
    )
    return DrainingServer(uv_config, ctx.drain, ctx.engine, config.shutdown_grace_s)


def run_server(
    model: str, config: ServerConfig, engine_kwargs: dict[str, Any], live_doctor: LiveDoctor | None = None
) -> int:
    ctx = build_context(model, config, engine_kwargs, live_doctor)
    server = make_server(ctx, config)
    base = f"http://{config.host}:{config.port}"
    print(f"[kvflow serve] {ctx.served_model_name} at {base}/v1 (metrics: {base}/metrics)", file=sys.stderr)
    print(f"[kvflow serve] {ctx.engine.engine.kv_pool_summary}", file=sys.stderr)
    if ctx.engine.engine.kv_cache_config.is_hybrid:
        print(f"[kvflow serve] {ctx.engine.engine.kv_groups_summary}", file=sys.stderr)
    if ctx.dashboard is not None:
        print(f"[kvflow serve] live dashboard: {base}/dashboard", file=sys.stderr)
    # uvicorn handles SIGINT/SIGTERM while it runs (graceful drain), then re-raises the signal into the
    # handlers it found: these no-ops make the drained shutdown an ordinary exit with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _after_graceful_shutdown)
    server.run()
    print("[kvflow serve] stopped", file=sys.stderr)
    return server.exit_code  # 1 when the engine failed (shutdown.py)


def _after_graceful_shutdown(signum: int, frame: FrameType | None) -> None:
    logger.debug("signal %d after the graceful shutdown: exiting normally", signum)
