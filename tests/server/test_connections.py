"""Clients that stall or leave: a connection that never completes its request head is closed, a body
that never arrives gets 408, and abandoned streams and half-sent bodies leave nothing behind (the KV
pool back to empty, the engine idle, the next request served)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from fixtures.live_server import LiveServer

# A generous bound for "the server acted on its deadline" (the deadline itself is 0.5 s).
DEADLINE_BOUND_S = 20.0


def connect(server: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_BOUND_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.fixture(scope="module")
def strict_server(start_server: Callable[..., LiveServer]) -> LiveServer:
    return start_server(client_timeout_s=0.5)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_without_a_complete_request_head_is_closed(
    strict_server: LiveServer, sent: bytes
) -> None:
    with connect(strict_server) as sock:
        sock.sendall(sent)
        assert read_until_closed(sock) == b""  # closed, nothing to answer before a request head


def test_a_keep_alive_connection_gets_a_new_deadline_per_request(strict_server: LiveServer) -> None:
    with connect(strict_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # half of the next request head, then nothing
        assert read_until_closed(sock) == b""


def test_a_body_that_never_arrives_gets_408(strict_server: LiveServer) -> None:
    with connect(strict_server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        response = read_until_closed(sock)
    assert response.startswith(b"HTTP/1.1 408")
    body = json.loads(response.split(b"\r\n\r\n", 1)[1])
    assert "did not arrive within 0.5 s" in body["error"]["message"]


def test_a_declared_oversized_body_is_refused_before_it_is_uploaded(server: LiveServer) -> None:
    """A client waiting for `100 Continue` gets the 413 instead, and never sends the 20 MB."""
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: 20000000\r\n\r\n"
        )
        response = read_until_closed(sock)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"larger than this server accepts" in response


def test_abandoned_streams_and_half_sent_bodies_leave_nothing_behind(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = server.ctx.engine.engine.model_runner
    execute = runner.execute_model

    def slow_execute(*args: Any) -> Any:  # the streams must still be running when abandoned
        time.sleep(0.005)
        return execute(*args)

    monkeypatch.setattr(runner, "execute_model", slow_execute)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    streams = []
    for _ in range(20):
        sock = connect(server)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        streams.append(sock)
    for sock in streams:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # the head and the first chunk(s)
        sock.close()
    for _ in range(10):  # a declared body, a fraction of it sent, then gone
        with connect(server) as sock:
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"pro')
    server.wait_until_idle()
    pool = server.ctx.engine.engine.scheduler.kv_cache_manager.block_pool
    assert pool.usage == 0.0 and pool.get_num_free_blocks() == pool.num_usable_blocks
    server.ctx.engine.engine.scheduler.check_integrity()
    with server.client() as http:
        ok = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert ok.status_code == 200
