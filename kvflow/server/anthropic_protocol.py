"""The Anthropic Messages API's request body (POST /v1/messages, as the `anthropic` client sends it),
its error body, and the stop reason and usage of its answers (shared by the whole answer and the
stream). Only what kvflow serves is accepted: an unknown field or block type is a 400
naming it, not silently dropped.

Error bodies: `{"type": "error", "error": {"type": <below>, "message": ...}}`
    400 invalid_request_error  401 authentication_error  403 permission_error  404 not_found_error
    413 request_too_large      429 rate_limit_error      500 api_error         503 overloaded_error
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvflow.server.protocol import cached_prompt_tokens

ANTHROPIC_PATH_PREFIX = "/v1/messages"
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}


def anthropic_error_body(status: HTTPStatus, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a hint for Anthropic's cache: kvflow caches prefixes itself


class ImageBlock(_Strict):
    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document"]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ContentBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolParam(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(_Strict):
    model_config = ConfigDict(extra="allow")  # display, ... : how Anthropic's own models show it
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: str | None = None  # a hint to Anthropic's models; kvflow's follow their template
    format: OutputFormat | None = None


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None  # format: structured output (response_format json_schema)
    metadata: dict[str, Any] | None = None
    # Hints for Anthropic's own service, accepted and not used: kvflow caches prefixes by itself and
    # has one region, tier and speed.
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    container: Any = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingParam | None = None


# chat finish_reason -> Messages stop_reason (stop: end_turn, or stop_sequence when a stop string matched)
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_fields(finish_reason: str | None, stop_reason: Any, body: MessagesRequest) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if (
        finish_reason == "stop"
        and isinstance(stop_reason, str)
        and stop_reason in (body.stop_sequences or ())
    ):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish_reason or "", "end_turn"), None


def message_usage(usage: dict[str, Any]) -> dict[str, int]:
    cached = cached_prompt_tokens(usage)
    return {
        "input_tokens": int(usage.get("prompt_tokens", 0)) - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": int(usage.get("completion_tokens", 0)),
    }
