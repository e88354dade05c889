"""Exception types that carry enough context to become a precise user-facing message.

The server (a later layer) maps them to HTTP codes: `ModelLoadError` -> 404/500 at start-up,
`InvalidRequestError` -> 400, `PromptTooLongError` -> 400 (OpenAI answers context overflow with 400),
`EngineOverloadedError` -> 429, `RequestFailedError` -> 500.
"""

from __future__ import annotations


class KVFlowError(Exception):
    """Base class of every error kvflow raises on purpose."""


class ModelLoadError(KVFlowError):
    """A checkpoint directory cannot be loaded: missing file, unknown architecture, bad tensor."""


class InvalidRequestError(KVFlowError, ValueError):
    """A request (prompt or sampling parameters) is invalid; the engine keeps serving others."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one output token) does not fit in `max_model_len`."""


class EngineOverloadedError(KVFlowError):
    """The waiting queue is full (`max_waiting`); the client should retry later."""


class RequestFailedError(KVFlowError):
    """Processing one request failed inside the engine; the engine keeps serving the others."""
