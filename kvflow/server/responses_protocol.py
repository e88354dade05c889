"""The OpenAI Responses API's request body (POST /v1/responses, `client.responses.create`).

What the chat path cannot do is refused by name (400): `background`, `conversation`, stored
`prompt` templates, built-in tools (web search, file search, ...). Hints for OpenAI's own service
(`prompt_cache_key`, `service_tier`, `safety_identifier`, ...) are accepted and not used.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvflow.server.protocol import cached_prompt_tokens


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity: a hint to OpenAI's models
    format: TextFormat | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None  # none / minimal / low / ...: "none" turns the template's thinking off
    summary: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


def response_object(
    body: ResponsesRequest,
    response_id: str,
    model: str,
    output: list[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    incomplete = finish_reason == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": output,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "tool_choice": body.tool_choice
        if isinstance(body.tool_choice, str) or body.tool_choice is None
        else body.tool_choice.model_dump(),
        "tools": body.tools or [],
        "text": {"format": {"type": "text"}}
        if body.text is None
        else body.text.model_dump(by_alias=True, exclude_none=True),
        "store": body.store,
        "metadata": body.metadata or {},
        "usage": None if usage is None else responses_usage(usage),
    }


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = cached_prompt_tokens(usage)
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }
