"""Chat tools: tool_choice -> what the template sees, the output's constraint, and the reading of the
output into `message.tool_calls` (non-streamed) or OpenAI's tool-call deltas (streamed).

    none       no tools reach the template; the output is content
    auto       the template gets the tools; the --tool-call-parser reads calls out of the output
    required   the output is held to [{"name", "parameters"}, ...] of the listed tools (constrained.py)
    named      the output is held to the named function's parameters schema

A streamed call is sent as OpenAI sends it: the first piece carries index, id, type and the name
(arguments ""), later pieces carry argument fragments only; concatenated they equal the non-streamed
call. Required / named stream their arguments as they are generated; auto holds text back from where
a call may start, and sends each call whole once the output is complete (the parser needs the whole
call to tell a call from text that looks like one).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import StructuredOutputsParams
from kvflow.server.errors import APIError
from kvflow.server.protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from kvflow.server.structured_request import Validate
from kvflow.server.tool_parsers import ParsedToolCall, ToolParser, get_tool_parser
from kvflow.server.tool_parsers.constrained import parameters_schema, required_schema, split_required_calls

ToolMode = Literal["none", "auto", "required", "named"]
TOOL_CALLS_FINISH = "tool_calls"


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    tools: list[dict[str, Any]]  # as the client sent them ({"type": "function", "function": {...}})
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools if self.mode != "none" and self.tools else None

    @property
    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            function = next(f for f in self.functions if f["name"] == self.named)
            return StructuredOutputsParams(json=parameters_schema(function))
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.functions, self.parallel))
        return None


def _bad(message: str, param: str) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


def plan_tools(
    body: ChatCompletionRequest, parser_name: str, chat_template: str | None, validate: Validate
) -> ToolPlan:
    """The request's tool plan; 400 for a tool_choice naming no listed tool, tool_choice without
    tools, a forced call together with another output constraint, or a tool schema that cannot compile."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise _bad(f"tool_choice {_describe(choice)} needs tools", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tools must have distinct function names", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise _bad(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                f"({', '.join(names)})",
                "tool_choice",
            )
        plan = ToolPlan("named", tools, named=choice.function.name, parallel=body.parallel_tool_calls)
    elif choice in ("required", "auto"):
        plan = ToolPlan(choice, tools, parallel=body.parallel_tool_calls)
    else:
        plan = ToolPlan("none", tools)
    if plan.mode == "auto":
        plan = ToolPlan(
            "auto",
            tools,
            parallel=body.parallel_tool_calls,
            parser=get_tool_parser(parser_name, chat_template),
        )
    constraint = plan.constraint()
    if constraint is not None:
        if (body.response_format is not None and body.response_format.type != "text") or _guided(body):
            raise _bad("a forced tool call cannot be combined with another output constraint", "tool_choice")
        try:
            validate(constraint, "tools")
        except InvalidRequestError as exc:
            raise _bad(f"the tools' parameter schemas do not compile: {exc}", "tools") from exc
    return plan


def _guided(body: ChatCompletionRequest) -> bool:
    fields = (
        body.structured_outputs,
        body.guided_json,
        body.guided_regex,
        body.guided_choice,
        body.guided_grammar,
    )
    return any(f is not None for f in fields)


def _describe(choice: object) -> str:
    return repr(choice.function.name) if isinstance(choice, NamedToolChoice) else repr(choice)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------- non-streamed


def final_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """The finished output -> (content, calls)."""
    if plan.mode == "named":
        assert plan.named is not None
        return None, [ParsedToolCall(plan.named, text)]
    if plan.mode == "required":
        return None, [ParsedToolCall(s.name, s.arguments) for s in split_required_calls(text)]
    if plan.mode == "auto":
        assert plan.parser is not None
        extracted = plan.parser.extract(text)
        return extracted.content, extracted.calls
    return text, []


def final_message(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[ChatResponseMessage, str | None]:
    content, calls = final_calls(plan, text)
    if not calls:
        return ChatResponseMessage(content=text), finish_reason
    tool_calls = [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]
    return ChatResponseMessage(content=content, tool_calls=tool_calls), _tool_finish(finish_reason)


def _tool_finish(finish_reason: str | None) -> str | None:
    """A complete output with calls ends in "tool_calls"; a length cap stays "length"."""
    return TOOL_CALLS_FINISH if finish_reason == "stop" else finish_reason


# ---------------------------------------------------------------------------------- streamed


@dataclass
class ToolCallStreamer:
    """One choice's stream: engine text deltas -> (content delta, tool-call deltas)."""

    plan: ToolPlan
    text: str = ""
    content_sent: int = 0  # auto: characters of `text` already sent as content
    sent: list[int] = field(default_factory=list)  # per call: argument characters already sent

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += delta
        if self.plan.mode == "named":
            assert self.plan.named is not None
            return None, self._spans([(self.plan.named, self.text)])
        if self.plan.mode == "required":
            return None, self._spans([(s.name, s.arguments) for s in split_required_calls(self.text)])
        assert self.plan.parser is not None
        # Content up to where a call may start, less trailing whitespace (held back: before a call
        # it is not content, as the non-streamed message strips it).
        certain = len(self.text[: self.plan.parser.content_prefix(self.text)].rstrip())
        if not finished:
            return self._content(certain), []
        _, calls = final_calls(self.plan, self.text)
        if not calls:
            return self._content(len(self.text)), []
        return self._content(certain), self._spans([(c.name, c.arguments) for c in calls])

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return _tool_finish(finish_reason) if self.called else finish_reason

    def _content(self, upto: int) -> str | None:
        if upto <= self.content_sent:
            return None
        piece, self.content_sent = self.text[self.content_sent : upto], upto
        return piece

    def _spans(self, calls: list[tuple[str, str]]) -> list[DeltaToolCall]:
        deltas: list[DeltaToolCall] = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self.sent):
                self.sent.append(len(arguments))
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=new_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=name, arguments=arguments),
                    )
                )
            elif len(arguments) > self.sent[index]:
                piece, self.sent[index] = arguments[self.sent[index] :], len(arguments)
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece)))
        return deltas


def tool_call_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier assistant tool calls carry `arguments` as JSON text (OpenAI's shape); templates (Qwen2.5's,
    Llama-3.1's) write `arguments | tojson` and expect the object, as transformers and vLLM pass it."""
    result = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_call_with_object_arguments(c) for c in calls]}
        result.append(message)
    return result


def _call_with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call  # left as the client sent it
    return {**call, "function": {**function, "arguments": arguments}}
