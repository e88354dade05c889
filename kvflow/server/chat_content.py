"""Chat messages as the checkpoint's template expects them: content as one string.

Current clients (the OpenAI API, its libraries, every UI built on them) send content as a list of
parts, `[{"type": "text", "text": "..."}]`, while text-only chat templates concatenate `content` as a
string. Text parts are joined with a newline, as vLLM does for text-only models ("string" content
format). Parts kvflow's text-only models cannot take (images, audio, files) are refused, naming the
part and its type, rather than silently dropped; so are template variables that would replace the
request's own arguments (`chat_template_kwargs: {"messages": ...}`).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from kvflow.server.errors import APIError
from kvflow.server.protocol import ChatMessage, ContentPart
from kvflow.tokenizer import RESERVED_TEMPLATE_VARIABLES

TEXT_PART_TYPES = frozenset({"text", "input_text"})  # input_text: the Responses API's spelling
# An assistant turn the client replays may carry its refusal as a part; it is text to the template.
REFUSAL_PART_TYPE = "refusal"


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as plain dicts for the template, each content a string (or absent)."""
    result = []
    for m_index, message in enumerate(messages):
        plain = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            plain["content"] = _flatten(message.content, f"messages.{m_index}.content")
        result.append(plain)
    return result


def _flatten(parts: list[ContentPart], where: str) -> str:
    texts = []
    for p_index, part in enumerate(parts):
        if part.type in TEXT_PART_TYPES:
            if part.text is None:
                part_at = f"{where}.{p_index}"
                raise APIError(HTTPStatus.BAD_REQUEST, f"{part_at}: a text part needs `text`", part_at)
            texts.append(part.text)
        elif part.type == REFUSAL_PART_TYPE:
            texts.append(str(getattr(part, "refusal", "") or ""))
        else:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"{where}.{p_index}: content parts of type {part.type!r} are not supported; this server's "
                "model takes text only (parts of type 'text')",
                param=f"{where}.{p_index}.type",
            )
    return "\n".join(texts)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    clash = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs or {}))
    if clash:
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            f"chat_template_kwargs may not set {', '.join(clash)}: the request's own fields give them",
            param=f"chat_template_kwargs.{clash[0]}",
        )
