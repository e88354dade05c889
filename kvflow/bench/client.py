"""The streaming client: sends one request to an OpenAI-compatible server and records raw events.

Token counts per chunk. A `usage` block is a running total on some servers (vLLM's and kvflow's
`continuous_usage_stats`: every chunk) and the request's final total on others (llama.cpp's
llama-server puts it on its last chunk, which has no text and a `finish_reason`; OpenAI on a
`choices: []` chunk). Either way a chunk carrying text is booked `completion_tokens` minus what the
earlier chunks already account for (at least one: text is a token), and a chunk without text is
booked none unless the server streams running totals, so a final total never piles every token
on the last chunk. Without usage, the chunk's
text is tokenized with the model's tokenizer (approximate across a chunk boundary that splits a
multi-byte character), else counted as one token. The request's output count: the final `usage`
first, then the server's `/tokenize`, then the local tokenizer (kvflow/bench/runner.py fills in the
last two and warns on disagreement).

Transport: aiohttp, as vLLM's benchmark_serving. A streamed chunk costs the client 43 us of CPU
against 95 through httpx (8 streams of 3 ms gaps, benchmarks/client_overhead.py): 11% of a core
against 25%, which a server sharing the machine with its load generator loses from its steps. A
pooled keep-alive connection the server closed meanwhile (llama-server does: 1-3 of 48 requests per
run failed "Can not write request body") is tried again, as httpx's pool does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from kvflow.bench.events import ChunkEvent, ChunkKind, RequestRecord

# The request-id header kvflow and vLLM take from a client (and echo): the server's records of the
# request carry it.
REQUEST_ID_HEADER = "X-Request-Id"

Endpoint = Literal["chat", "completions"]
# The message of an HTTP error is cut to this many characters in the records.
MAX_ERROR_CHARS = 500
# aiohttp's read buffer; a stream line (one SSE event) may be twice this long (its reader's limit):
# 2 MiB holds a chunk with top-20 logprobs of long tokens many times over.
STREAM_READ_BUFSIZE = 2**20
# Tries of one request on pooled connections the server may have closed (_post): llama-server's
# closed ones failed 1-3 of 48 requests per run with one retry, none in three runs with three tries.
STALE_CONNECTION_TRIES = 3


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # ends with /v1
    model: str
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    ignore_eos: bool = True  # output lengths exact (vLLM/kvflow extension; others ignore it)
    continuous_usage_stats: bool = True  # per-chunk token counts (vLLM/kvflow extension)
    include_usage: bool = True  # ask for the final usage chunk (OpenAI's stream_options)
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Prompt:
    """What one request sends: chat messages, or a completions prompt (text or token ids)."""

    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    num_tokens: int = 0  # the workload's input length (the server's usage replaces it when given)
    num_chars: int = 0
    priority: int | None = None  # vLLM's `priority` field (kvflow/bench/priority.py); None: not sent


def request_body(config: ClientConfig, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": prompt.max_tokens,
        "temperature": config.temperature,
        "stream": True,
        **config.extra_body,
    }
    if config.include_usage:
        body["stream_options"] = {"include_usage": True}
        if config.continuous_usage_stats:
            body["stream_options"]["continuous_usage_stats"] = True
    if config.ignore_eos:
        body["ignore_eos"] = True
    if prompt.priority is not None:
        body["priority"] = prompt.priority
    if config.endpoint == "chat":
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.prompt
    return body


class StreamParser:
    """Turns SSE `data:` payloads into ChunkEvents on a record (pure: no I/O, unit-tested directly)."""

    def __init__(self, record: RequestRecord, endpoint: Endpoint, count_tokens: Callable[[str], int] | None):
        self.record = record
        self.endpoint = endpoint
        self.count_tokens = count_tokens
        self.usage_tokens: int | None = None  # completion tokens per the last usage seen
        self.booked_tokens = 0  # tokens booked on the chunks so far
        # Content chunks with text, or without text before the last one (a token whose text is held
        # back: half a UTF-8 character): the chunks a token-by-token stream sends one per token.
        self.token_chunks: list[int] = []
        self.local_counted = False  # some chunk was counted without usage (tokenizer or one each)

    def feed(self, data: str, now: float) -> bool:
        """One `data:` payload; returns False at [DONE]."""
        if data.strip() == "[DONE]":
            return False
        payload = json.loads(data)
        if "error" in payload:
            error = payload["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self.record.error = f"error event mid-stream: {message}"[:MAX_ERROR_CHARS]
            return True
        usage = payload.get("usage") or None
        running_total = self.usage_tokens is not None  # usage came before: a running total
        if usage is not None:
            self._set_usage(usage)
        if isinstance(payload.get("timings"), dict):  # llama-server's own per-request timings
            self.record.server_timings = payload["timings"]
        choices = payload.get("choices") or []
        if not choices:
            if usage is not None:
                self.record.chunks.append(ChunkEvent(now, "usage", 0))
            return True
        text, kind = self._text_and_kind(choices[0])
        # A usage block before the stream's last chunk is a running total too.
        running_total = running_total or choices[0].get("finish_reason") is None
        num_tokens = self._chunk_tokens(text, usage, running_total)
        self.booked_tokens += num_tokens
        self.record.output_text += text
        if kind == "content" and (text or choices[0].get("finish_reason") is None):
            self.token_chunks.append(len(self.record.chunks))  # may carry a token, see finish()
        self.record.chunks.append(ChunkEvent(now, kind, num_tokens, text))
        return True

    def _chunk_tokens(self, text: str, usage: dict[str, Any] | None, running_total: bool) -> int:
        """Tokens a chunk carries: with usage, the total minus what the earlier chunks were booked
        (a running total and a final total both read right), at least one when there is text. A
        chunk without text carries none, except an increment of a running total: a token the server
        produced then whose text is not out yet (a special token, half a character)."""
        if usage is not None and "completion_tokens" in usage:
            unbooked = int(usage["completion_tokens"]) - self.booked_tokens
            if text:
                return max(unbooked, 1)
            return max(unbooked, 0) if running_total else 0
        if not text:
            return 0
        self.local_counted = True
        if self.count_tokens is not None:
            return max(self.count_tokens(text), 1)  # text is at least a token
        return 1  # no usage, no tokenizer: one token per chunk (what most servers send)

    def _one_token_per_chunk_when_forced(self) -> None:
        """A final total equal to the number of token-carrying chunks means one token each (a
        server streaming token by token, as llama-server does): it replaces the local tokenizer's
        per-chunk guesses, which split the same text differently."""
        n = len(self.token_chunks)
        if n and self.usage_tokens == n and self.booked_tokens != n:
            for i, chunk in enumerate(self.record.chunks):
                chunk.num_tokens = 1 if i in self.token_chunks else 0
            self.booked_tokens = n

    def _reconcile_local_counts(self) -> None:
        """Local per-chunk counts that add up to more or fewer tokens than the final total (the local
        tokenizer splits the server's text its own way): trimmed from, or added to, the chunks
        counted largest, so that the chunks add up to the request's total."""
        if not self.local_counted:
            return
        chunks = sorted((c for c in self.record.chunks if c.text), key=lambda c: -c.num_tokens)
        excess = self.booked_tokens - (self.usage_tokens or 0)
        for chunk in chunks:
            if excess == 0:
                break
            change = min(excess, chunk.num_tokens - 1) if excess > 0 else excess
            chunk.num_tokens -= change
            excess -= change
        self.booked_tokens = (self.usage_tokens or 0) + excess

    def _text_and_kind(self, choice: dict[str, Any]) -> tuple[str, ChunkKind]:
        if self.endpoint == "chat":
            delta = choice.get("delta") or {}
            # Reasoning tokens are output tokens too (their gaps are ITL, their time TPOT): vLLM and
            # SGLang send them as reasoning_content (newer vLLM: reasoning), llama-server likewise.
            text = (delta.get("content") or "") + (
                delta.get("reasoning_content") or delta.get("reasoning") or ""
            )
            if delta.get("role") and not text and choice.get("finish_reason") is None:
                return "", "role"
            return text, "content"
        return choice.get("text") or "", "content"

    def _set_usage(self, usage: dict[str, Any]) -> None:
        if "completion_tokens" in usage:
            self.usage_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens"):
            self.record.prompt_tokens = int(usage["prompt_tokens"])

    def finish(self, now: float) -> None:
        self.record.end_time = now
        if self.usage_tokens is not None:
            self.record.output_tokens = self.usage_tokens
            self.record.token_count_source = "usage"
            self._one_token_per_chunk_when_forced()
            self._reconcile_local_counts()
        else:
            self.record.output_tokens = sum(c.num_tokens for c in self.record.chunks)
            self.record.token_count_source = "local"


def stream_session(timeout_s: float) -> aiohttp.ClientSession:
    """The session the measured requests stream through (module docstring): no cap on connections
    (the load decides the concurrency), each read allowed `timeout_s`, proxies from the environment
    as httpx and requests take them."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s),
        read_bufsize=STREAM_READ_BUFSIZE,
        trust_env=True,
    )


async def send_request(
    session: aiohttp.ClientSession,
    config: ClientConfig,
    prompt: Prompt,
    record: RequestRecord,
    count_tokens: Callable[[str], int] | None,
) -> RequestRecord:
    """Stream one request into `record` (failures are recorded in `record.error`, never raised)."""
    path = "/chat/completions" if config.endpoint == "chat" else "/completions"
    parser = StreamParser(record, config.endpoint, count_tokens)
    record.prompt_tokens = record.prompt_tokens or prompt.num_tokens
    record.prompt_chars = prompt.num_chars
    record.priority = prompt.priority
    headers = config.headers
    if record.x_request_id is not None:
        headers[REQUEST_ID_HEADER] = record.x_request_id
    url = config.base_url.rstrip("/") + path
    record.send_time = time.perf_counter()
    try:
        response = await _post(session, url, request_body(config, prompt), headers)
        async with response:
            if response.status != 200:
                body = (await response.read()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status}: {_error_message(body)}"[:MAX_ERROR_CHARS]
                return record
            async for line in response.content:  # one line at a time, its \n kept
                if line.startswith(b"data:") and not parser.feed(
                    line[len(b"data:") :].decode("utf-8").strip(), time.perf_counter()
                ):
                    break
            else:
                record.error = record.error or "the stream ended before data: [DONE]"
        parser.finish(time.perf_counter())
        if record.error is None and not record.content_chunks:
            record.error = "the stream ended without any content"
    # ValueError: a payload that is not JSON or not UTF-8; HttpProcessingError: a line past the
    # reader's limit (LineTooLong), or a malformed response.
    except (aiohttp.ClientError, HttpProcessingError, asyncio.TimeoutError, ValueError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    return record


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> aiohttp.ClientResponse:
    """POST, again when the pooled connection it took fails before any response (the server closed
    it while it sat idle in the pool: writing the request fails, or the server hangs up without a
    status line); the failed connection leaves the pool, so the next try takes another or a new
    one. Past STALE_CONNECTION_TRIES, the failure is the request's."""
    for _ in range(STALE_CONNECTION_TRIES - 1):
        try:
            return await session.post(url, json=body, headers=headers)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            continue
    return await session.post(url, json=body, headers=headers)


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        return str(error if error is not None else body)
    except (json.JSONDecodeError, AttributeError):
        return body
