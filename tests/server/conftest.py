"""Server fixtures: one shared default server, plus `start_server(...)` for other configurations."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures.live_server import ENGINE_KWARGS, LiveServer

from kvflow.server.launcher import ServerConfig


@pytest.fixture(scope="session")
def server_model_dir(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="session")
def start_server(server_model_dir: Path) -> Iterator[Callable[..., LiveServer]]:
    """`start_server(server_config_kwargs..., engine=dict)` -> a running LiveServer, stopped at the end."""
    servers: list[LiveServer] = []

    def start(engine: dict[str, Any] | None = None, **config: Any) -> LiveServer:
        config.setdefault("served_model_name", "tiny-llama")
        server = LiveServer(server_model_dir, ServerConfig(**config), {**ENGINE_KWARGS, **(engine or {})})
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server: Callable[..., LiveServer]) -> LiveServer:
    """The shared default server (no API key, no queue limit)."""
    return start_server()
