"""`kvflow serve` as a user runs it: a subprocess that prints its URL and KV pool, serves, and on
SIGINT lets the in-flight stream finish before exiting with status 0. Its flags, generated from
ServerConfig's fields, are checked in-process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

import kvflow.server.launcher
from kvflow.cli import main
from kvflow.config import API_KEY_ENV, EngineConfig, ServerConfig
from kvflow.server.spawn import spawn_server

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_serve_prints_its_url_serves_and_drains_on_sigint(server_model_dir: Path) -> None:
    flags = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256"]
    process, base = spawn_server(server_model_dir, flags, cwd=REPO_ROOT, stderr=subprocess.PIPE)
    try:
        body = {"model": "tiny", "prompt": "x = ", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            process.send_signal(signal.SIGINT)  # mid-stream
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(first[len("data: ") :])["choices"][0]["text"] is not None
        final = json.loads(rest[-2][len("data: ") :])
        assert final["choices"][0]["finish_reason"] == "length" and rest[-1] == "data: [DONE]"
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    assert f"tiny at {base}/v1" in stderr
    assert "KV cache pool:" in stderr and "[kvflow serve] stopped" in stderr


def test_serve_with_a_wrong_model_path_exits_with_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "serve", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert "kvflow: error:" in result.stderr and str(missing) in result.stderr


def _serve_config(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[str, ServerConfig, dict[str, Any]]:
    """What `kvflow ARGV` hands to run_server (which is not run)."""
    calls: list[tuple[str, ServerConfig, dict[str, Any]]] = []

    def fake_run_server(
        model: str, config: ServerConfig, engine_kwargs: dict[str, Any], live_doctor: object = None
    ) -> int:
        # The dashboard's doctor view comes with the dashboard, from the CLI (the server cannot import it).
        assert (live_doctor is not None) == config.dashboard
        calls.append((model, config, engine_kwargs))
        return 0

    monkeypatch.setattr(kvflow.server.launcher, "run_server", fake_run_server)
    assert main(list(argv)) == 0
    return calls[0]


def test_serve_flag_defaults_are_the_server_config_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    model, config, engine_kwargs = _serve_config(monkeypatch, "serve", "MODEL")
    assert model == "MODEL" and config == ServerConfig()
    assert EngineConfig.from_kwargs(model=model, **engine_kwargs) == EngineConfig.from_kwargs(model=model)


def test_serve_flags_reach_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    _, config, engine_kwargs = _serve_config(
        monkeypatch,
        "--log-level", "warning", "serve", "MODEL", "--host", "0.0.0.0", "--port", "9001",
        "--served-model-name", "tiny", "--max-waiting", "3", "--shutdown-grace-seconds", "0.5",
        "--quality-probe-rate", "0.25", "--no-enable-prefix-caching", "--kv-cache-dtype", "int8",
        "--no-dashboard", "--dashboard-window-seconds", "60",
    )  # fmt: skip
    assert config == ServerConfig(
        host="0.0.0.0",
        port=9001,
        served_model_name="tiny",
        api_key="from-env",  # no --api-key: the environment's
        max_waiting=3,
        shutdown_grace_s=0.5,
        log_level="warning",
        quality_probe_rate=0.25,
        dashboard=False,
        dashboard_window_s=60.0,
    )
    assert engine_kwargs["enable_prefix_caching"] is False and engine_kwargs["kv_cache_dtype"] == "int8"
    _, config, _ = _serve_config(monkeypatch, "serve", "MODEL", "--api-key", "from-flag")
    assert config.api_key == "from-flag"
