"""Wiring: one Dashboard per server, its recorder on the engine thread, its hub on the event loop."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.server.dashboard.doctor_window import LiveDoctor
from kvflow.server.dashboard.hub import DashboardHub
from kvflow.server.dashboard.recorder import StepRecorder
from kvflow.server.dashboard.routes import install_dashboard_routes
from kvflow.server.dashboard.window import WindowLimits
from kvflow.server.metrics import EngineMetrics
from kvflow.server.shutdown import DrainState

# 4 updates a second: smooth enough to watch, and the page redraws at most that often.
DEFAULT_INTERVAL_S = 0.25


@dataclass
class Dashboard:
    hub: DashboardHub
    recorder: StepRecorder
    model_dir: str
    live_doctor: LiveDoctor | None = None

    def start(self) -> None:
        """On the event loop, as the app starts (api.py's lifespan)."""
        self.hub.start()

    def stop(self) -> None:
        self.hub.stop()

    def install(self, app: FastAPI, drain: DrainState) -> None:
        install_dashboard_routes(app, self.hub, drain, self.model_dir, self.live_doctor)


def attach_dashboard(
    engine: AsyncLLMEngine,
    metrics: EngineMetrics,
    served_model_name: str,
    model_dir: str,
    window_s: float,
    live_doctor: LiveDoctor | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
) -> Dashboard:
    """Subscribe a dashboard to `engine`'s steps (call before the engine thread starts)."""
    llm = engine.engine
    cache, sched = llm.config.cache_config, llm.config.scheduler_config
    config = {
        "model": served_model_name,
        "num_blocks": llm.num_kv_blocks,
        "block_size": cache.block_size,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "speculative_method": llm.config.speculative_config.speculative_method,
        "doctor": live_doctor is not None,
    }
    hub = DashboardHub(config, metrics.render, interval_s, WindowLimits(window_s=window_s))
    recorder = StepRecorder(llm, hub.publish_threadsafe, hub.watched, interval_s)
    engine.add_step_observer(recorder)
    return Dashboard(hub, recorder, model_dir, live_doctor)
