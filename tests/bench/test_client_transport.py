"""The bench's streaming transport (aiohttp, kvflow/bench/client.py) against what servers send: long
SSE lines, a stream cut mid-way, a payload that is not JSON, a server that is not there. Each ends
as an error on its own record (never an exception out of the run), beside requests that succeed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fixtures.app_server import serve_app

from kvflow.bench.client import STREAM_READ_BUFSIZE, ClientConfig, Prompt, send_request, stream_session
from kvflow.bench.events import RequestRecord
from kvflow.server.spawn import free_port

TOKENS = 4
# A chunk past aiohttp's default line limit (2 x its 256 KiB read buffer), inside the bench's own.
LONG_TEXT_CHARS = 600_000


def chunk(text: str, n: int) -> str:
    usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": 1 + n}
    return "data: " + json.dumps({"choices": [{"index": 0, "text": text}], "usage": usage}) + "\n\n"


def transport_app() -> FastAPI:
    """The prompt (text) picks the behaviour: ok, long, cut, garbage, too_long."""
    app = FastAPI()

    async def stream(kind: str) -> AsyncIterator[str]:
        for n in range(1, TOKENS + 1):
            if kind == "cut" and n == 3:
                raise RuntimeError("the server dies mid-stream")  # uvicorn drops the connection
            if kind == "garbage" and n == 2:
                yield "data: {not json\n\n"
            text = "x" * LONG_TEXT_CHARS if kind == "long" and n == 2 else "x"
            if kind == "too_long" and n == 2:
                text = "x" * 3 * STREAM_READ_BUFSIZE
            yield chunk(text, n)
            await asyncio.sleep(0)
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        kind = (await request.json())["prompt"]
        return StreamingResponse(stream(kind), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serve_app(transport_app()) as url:
        yield url


def send_all(base_url: str, kinds: list[str]) -> list[RequestRecord]:
    """One request of each kind, all in flight at once through one session."""
    config = ClientConfig(base_url=base_url, model="m")

    async def run() -> list[RequestRecord]:
        async with stream_session(timeout_s=30) as session:
            records = [RequestRecord(i, 0.0, 0) for i in range(len(kinds))]
            prompts = [Prompt(max_tokens=TOKENS, prompt=kind) for kind in kinds]
            await asyncio.gather(
                *(send_request(session, config, p, r, None) for p, r in zip(prompts, records, strict=True))
            )
            return records

    return asyncio.run(run())


def test_long_lines_stream_and_broken_streams_fail_alone(base_url: str) -> None:
    ok, long, cut, garbage, too_long = send_all(base_url, ["ok", "long", "cut", "garbage", "too_long"])
    for record in (ok, long):
        assert record.error is None, record.error
        assert record.output_tokens == TOKENS and len(record.content_chunks) == TOKENS
    assert len(long.output_text) == LONG_TEXT_CHARS + TOKENS - 1
    assert cut.error is not None and "ClientPayloadError" in cut.error
    assert garbage.error is not None and "JSONDecodeError" in garbage.error
    assert too_long.error is not None and "LineTooLong" in too_long.error


def test_a_server_that_is_not_there_is_an_error_on_the_record() -> None:
    [record] = send_all(f"http://127.0.0.1:{free_port()}/v1", ["ok"])
    assert record.error is not None and record.error.startswith("ClientConnectorError")


def test_http_errors_carry_the_servers_message() -> None:
    app = FastAPI()

    @app.post("/v1/completions")
    async def refuse() -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)

    with serve_app(app) as url:
        [record] = send_all(url, ["ok"])
    assert record.error == "HTTP 400: prompt too long"


def test_a_pooled_connection_the_server_closed_is_retried_once() -> None:
    """A keep-alive connection the server drops when its next request comes (as llama-server's
    closes idle ones): the request goes again on another connection, and succeeds; a server that
    drops every request still fails it, once retried."""
    drops: list[int] = []

    async def serve(drop_all: bool) -> tuple[asyncio.AbstractServer, int]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            served = 0
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                if drop_all or served:
                    drops.append(1)  # the reused connection: hang up without a status line
                    writer.close()
                    return
                body = (chunk("x", 1) + "data: [DONE]\n\n").encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
                writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                served += 1

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return server, server.sockets[0].getsockname()[1]

    async def two_in_a_row(drop_all: bool) -> list[RequestRecord]:
        server, port = await serve(drop_all)
        config = ClientConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m")
        records = [RequestRecord(i, 0.0, 0) for i in range(2)]
        async with server, stream_session(timeout_s=30) as session:
            for record in records:  # one after the other: the second takes the first's connection
                await send_request(session, config, Prompt(max_tokens=1, prompt="ok"), record, None)
        return records

    first, second = asyncio.run(two_in_a_row(drop_all=False))
    assert first.error is None and second.error is None, (first.error, second.error)
    assert len(drops) == 1  # the second request did meet the dropped connection
    failed, _ = asyncio.run(two_in_a_row(drop_all=True))
    assert failed.error is not None and "ServerDisconnectedError" in failed.error
