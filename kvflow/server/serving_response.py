"""The response side that /v1/completions and /v1/chat/completions share: the engine's output stream
of one HTTP request -> SSE chunks (streamed) or one JSON body (not streamed).

The loop is written once, here; each endpoint supplies a `ResponseBuilder` with its object shapes and
the transform of one engine delta into one choice. A streamed response is, in order:

    builder.stream_head()                   chunks sent before the first engine output (chat: the role)
    one chunk per engine output             unless the builder has nothing to send for it;
                                            `usage` on each with stream_options.continuous_usage_stats,
                                            the choice's timing on its finishing chunk when asked for
    a chunk with no choices and the usage   with stream_options.include_usage
    data: [DONE]

An error after the first byte becomes an error event, then [DONE] (the status line is already sent).
A client that leaves cancels the generator and its engine requests are aborted (KV blocks freed).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvflow.engine.async_engine import OutputStream
from kvflow.outputs import RequestOutput
from kvflow.request import Request
from kvflow.server.errors import sse_error, to_api_error
from kvflow.server.metrics import timing_fields
from kvflow.server.protocol import PromptTokensDetails, StreamOptions, UsageInfo, _SamplingFields
from kvflow.server.serving import PromptInput, ServingContext, choice_index, wants_timing

StreamChoiceT = TypeVar("StreamChoiceT", bound=BaseModel)
ChoiceT = TypeVar("ChoiceT", bound=BaseModel)

SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnectedError(Exception):
    """The client went away while its non-streamed request ran (its engine requests are aborted)."""


class ResponseBuilder(ABC, Generic[StreamChoiceT, ChoiceT]):
    """What one endpoint supplies to the shared loop, for one HTTP request: its chunk and response
    objects, and how an engine output becomes a choice. `StreamChoiceT` is a choice inside a chunk,
    `ChoiceT` one inside the non-streamed response. Choices are numbered as `build_requests` numbers
    them (prompt index * n + j). A builder may keep per-choice state between the deltas of a stream.

    `chunk_type` and `response_type` are the endpoint's pydantic objects: both take id, created,
    model, choices, usage and kvflow (for completions they are one type)."""

    chunk_type: type[BaseModel]
    response_type: type[BaseModel]

    def __init__(self, response_id: str, model: str) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())  # one timestamp for every chunk of the response

    def stream_head(self) -> list[BaseModel]:
        """Chunks sent before the first engine output; none unless the endpoint's protocol has them."""
        return []

    @abstractmethod
    def stream_choice(self, index: int, output: RequestOutput) -> StreamChoiceT | None:
        """The endpoint's delta transform: choice `index`'s new engine output (its `delta_*` fields)
        -> the choice its chunk carries, or None to send nothing for it. Every output of the choice
        passes here in order, so a transform that holds text back until it can tell what the text is
        (a tool-call parser) keeps its buffer in the builder and returns None meanwhile."""

    def chunk(
        self,
        choices: list[StreamChoiceT],
        usage: UsageInfo | None = None,
        kvflow: dict[str, Any] | None = None,
    ) -> BaseModel:
        """A streamed chunk; the final usage chunk has no choices."""
        return self._envelope(self.chunk_type, choices, usage, kvflow)

    @abstractmethod
    def final_choice(self, index: int, final: RequestOutput) -> ChoiceT:
        """Choice `index` of a non-streamed response, from its request's final (cumulative) output."""

    def response(self, choices: list[ChoiceT], usage: UsageInfo, kvflow: dict[str, Any] | None) -> BaseModel:
        """The non-streamed response; `choices` are in index order."""
        return self._envelope(self.response_type, choices, usage, kvflow)

    def _envelope(
        self, object_type: type[BaseModel], choices: list[Any], usage: UsageInfo | None, kvflow: Any
    ) -> BaseModel:
        """The fields every chunk and response of this request share, around its choices."""
        return object_type(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            kvflow=kvflow,
        )


async def serve_choices(
    ctx: ServingContext,
    raw: HTTPRequest,
    body: _SamplingFields,
    prompts: list[PromptInput],
    requests: list[Request],
    builder: ResponseBuilder[Any, Any],
) -> Response:
    """Submit the engine requests of one HTTP request (one per choice) and answer: an SSE stream when
    `body.stream`, else one JSON body once every choice has finished."""
    stream = ctx.engine.add_requests(requests)
    timing = wants_timing(body, raw)
    if not body.stream:
        return await full_response(stream, raw, builder, body.n, timing)
    usage = StreamUsage([len(p.token_ids) for p in prompts], body.n)
    chunks = ChoiceStream(builder, body.stream_options, usage, timing).events(stream)
    return StreamingResponse(chunks, media_type="text/event-stream")


async def full_response(
    stream: OutputStream, raw: HTTPRequest, builder: ResponseBuilder[Any, Any], n: int, timing: bool
) -> JSONResponse:
    """The non-streamed answer: every choice's final output, aggregated into one response."""
    finals = await collect_finals(stream, raw)
    choices = [builder.final_choice(choice_index(final.request_id), final) for final in finals]
    response = builder.response(choices, usage_of(finals, n), kvflow_timing(finals) if timing else None)
    body = response.model_dump(exclude_none=True)
    transfer = next((f.kv_transfer_params for f in finals if f.kv_transfer_params is not None), None)
    if transfer is not None:  # prefill role: where the decode instance fetches this prompt's KV
        body["kv_transfer_params"] = transfer
    return JSONResponse(body)


@dataclass
class StreamUsage:
    """Token counts of a streamed response, kept as its outputs arrive. Like `usage_of`: a prompt's
    tokens count once for its n choices (choice index // n is the prompt's index)."""

    num_prompt_tokens: list[int]  # per prompt
    n: int
    num_completion_tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens so far
    num_cached_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> its cache hit

    def update(self, index: int, output: RequestOutput) -> None:
        self.num_completion_tokens[index] = len(output.outputs[0].token_ids)  # cumulative count
        if index % self.n == 0:
            self.num_cached_tokens[index // self.n] = output.num_cached_tokens

    def of_choice(self, index: int) -> UsageInfo:
        """One choice so far (continuous usage): its prompt, its tokens."""
        prompt = index // self.n
        return _usage(
            self.num_prompt_tokens[prompt],
            self.num_completion_tokens[index],
            self.num_cached_tokens.get(prompt, 0),
        )

    def total(self) -> UsageInfo:
        return _usage(
            sum(self.num_prompt_tokens),
            sum(self.num_completion_tokens.values()),
            sum(self.num_cached_tokens.values()),
        )


class ChoiceStream:
    """The SSE loop of one streamed response (order and failure handling in the module docstring)."""

    def __init__(
        self,
        builder: ResponseBuilder[Any, Any],
        options: StreamOptions | None,
        usage: StreamUsage,
        timing: bool,
    ) -> None:
        self.builder = builder
        self.include_usage = options is not None and options.include_usage
        self.continuous_usage = options is not None and options.continuous_usage_stats
        self.usage = usage
        self.timing = timing

    async def events(self, stream: OutputStream) -> AsyncIterator[str]:
        try:
            for chunk in self.builder.stream_head():
                yield sse(chunk)
            async for output in stream:
                delta = self._delta_chunk(output)
                if delta is not None:
                    yield sse(delta)
            if self.include_usage:
                yield sse(self.builder.chunk([], usage=self.usage.total()))
            yield SSE_DONE
        except Exception as exc:
            yield sse_error(to_api_error(exc))
            yield SSE_DONE
        finally:
            stream.close()  # aborts what is unfinished: an error, or the client gone (cancellation)

    def _delta_chunk(self, output: RequestOutput) -> BaseModel | None:
        index = choice_index(output.request_id)
        self.usage.update(index, output)
        choice = self.builder.stream_choice(index, output)
        if choice is None:
            return None
        usage = self.usage.of_choice(index) if self.continuous_usage else None
        kvflow = None
        if self.timing and output.finished:
            kvflow = {"timing": output_timing(output), "index": index}
        return self.builder.chunk([choice], usage, kvflow)


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"


def _usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


def usage_of(finals: list[RequestOutput], n: int) -> UsageInfo:
    """Prompt tokens count once per prompt (not per choice), as OpenAI and vLLM count them; so do
    their cached tokens (the first choice's: the others hit the same prefix)."""
    prompt = sum(len(f.prompt_token_ids) for f in finals[::n])
    completion = sum(len(f.outputs[0].token_ids) for f in finals)
    cached = sum(f.num_cached_tokens for f in finals[::n])
    return _usage(prompt, completion, cached)


def output_timing(output: RequestOutput) -> dict[str, Any]:
    return timing_fields(output.metrics, len(output.prompt_token_ids), len(output.outputs[0].token_ids))


def kvflow_timing(finals: list[RequestOutput]) -> dict[str, Any]:
    """`kvflow` field of a non-streamed response: choice 0's timing, plus every choice's if several."""
    result: dict[str, Any] = {"timing": output_timing(finals[0])}
    if len(finals) > 1:
        result["choice_timings"] = [output_timing(f) for f in finals]
    return result


async def wait_for_disconnect(raw: HTTPRequest) -> None:
    """Returns when the client has gone (the body is read: the next ASGI message is the disconnect)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_finals(stream: OutputStream, raw: HTTPRequest) -> list[RequestOutput]:
    """Final outputs of every request of the group, in choice order; aborts them if the client leaves."""
    finals: dict[str, RequestOutput] = {}

    async def collect() -> None:
        async for output in stream:
            if output.finished:
                finals[output.request_id] = output

    collect_task = asyncio.ensure_future(collect())
    disconnect_task = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({collect_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
        if not collect_task.done():
            raise ClientDisconnectedError("the client disconnected before the response was ready")
        collect_task.result()  # re-raises a failure
    finally:
        collect_task.cancel()
        disconnect_task.cancel()
        stream.close()
    return sorted(finals.values(), key=lambda f: choice_index(f.request_id))


async def chat_sse_data(chunks: AsyncIterable[str | bytes | memoryview]) -> AsyncIterator[str]:
    """The `data:` payloads of a chat completion stream's body (a JSON chunk, or "[DONE]"), as the
    Messages and Responses streams re-shape them; closes the stream when the consumer stops."""
    buffer = ""
    try:
        async for piece in chunks:
            buffer += piece if isinstance(piece, str) else bytes(piece).decode()
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                yield event.removeprefix("data: ").strip()
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
