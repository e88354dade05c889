"""OpenAI request/response schemas (pydantic), with vLLM's widely used extensions.

Requests are validated here: a wrong type or an out-of-range value becomes HTTP 400 naming the field.
Fields OpenAI defines that kvflow cannot honour (`suffix`, `best_of` > n) are accepted by the schema
and refused by the serving layer with a message, never silently ignored. Structured output comes in
OpenAI's `response_format`, vLLM's `structured_outputs` and vLLM's older `guided_*` fields (one of
them per request; server/structured_request.py turns them into SamplingParams.structured_outputs).
Unknown fields are ignored, as OpenAI and vLLM do.

Types are strict, so that the published schema is the server: `"n": "2"`, `"echo": 0` or
`"max_tokens": true` are refused, not coerced. Exactly what JSON Schema calls an integer is one:
2 and 2.0 (a number with no fractional part), so `Int` accepts an integral float; a JSON integer is
still a valid number. Floats must be finite (Python's JSON reader accepts NaN and Infinity). Text
must be valid Unicode: a lone surrogate ("\\ud800" in JSON) is refused here, naming the field,
instead of failing inside the tokenizer. Lists whose every item costs the shared engine thread work
per token (stop strings, stop token ids) are bounded.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from kvflow.tokenizer import check_unicode

# OpenAI's bounds: top_logprobs in [0, 20]; the legacy completions `logprobs` in [0, 5], which vLLM
# (and kvflow) loosen to 20 as well.
MAX_TOP_LOGPROBS = 20
# A seed is a signed 64-bit integer (OpenAI's and vLLM's range); choice j of n samples with seed + j.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# Every stop string is searched for after every token, in the engine thread that serves everyone:
# a request with a million of them would slow every stream. OpenAI allows 4; this is generous.
MAX_STOP_SEQUENCES = 64
MAX_STOP_TOKEN_IDS = 1024


def _unicode(text: str) -> str:
    check_unicode(text, "the text")  # its ValueError becomes a 400 naming the field
    return text


def _integral(value: Any) -> Any:
    """2.0 -> 2 (JSON Schema's integer); anything else is left to the strict int check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Text that reaches the tokenizer or the detokenizer.
Text = Annotated[str, AfterValidator(_unicode)]
Int = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[Int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class KVFlowOptions(_Request):
    timing: bool = False  # attach the request's latency breakdown to the final response / chunk


class JsonSchemaFormat(_Request):
    """response_format.json_schema: OpenAI's {name, description, schema, strict}."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow pydantic's
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` request field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Int = Field(1, ge=1, le=128)
    best_of: Int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: Int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    kvflow: KVFlowOptions | None = None
    # Prefill/decode disaggregation, as vLLM's router and proxies send it (kvflow/kv_transfer/params.py).
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: with --scheduling-policy priority, lower values are served first; 400 otherwise unless 0.
    priority: Int = 0


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's default for the legacy endpoint
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's extension
    echo: bool = False
    suffix: str | None = None


class ContentPart(_Request):
    """One part of a message's content, as current clients send it: {"type": "text", "text": ...}.
    Other types (image_url, input_audio, ...) are named in a 400 by the chat endpoint."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str
    text: Text | None = None


class ChatMessage(_Request):
    # name, tool_call_id, ... reach the template as they are
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: str
    content: Text | list[ContentPart] | None = None


class FunctionDefinition(_Request):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's extension
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# --------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """OpenAI's breakdown of the prompt tokens: `cached_tokens` were not computed for this request
    (prefix-cache hits in the KV pool, and blocks read back from the KV offload tier)."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per output token."""

    tokens: list[str] = Field(default_factory=list)
    # None for the first prompt token of an echoed prompt (nothing scores it), as OpenAI sends it.
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    # vLLM's shape: per prompt token, {token id: its logprob}; None for the first token.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kvflow: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool call's piece: id, type and name once (first piece), then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the text inside <think> ... </think>
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    kvflow: dict[str, Any] | None = None
    # vLLM's shape: per prompt token (the rendered chat prompt), {token id: its logprob}; None first.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    kvflow: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvflow"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """Every error answer's body (server/errors.py)."""

    error: ErrorInfo


def cached_prompt_tokens(usage: dict[str, Any]) -> int:
    """A chat usage block's prefix-cache hits (`prompt_tokens_details.cached_tokens`), 0 without."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
