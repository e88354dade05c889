"""Raw events of one benchmark request: what the client saw, when, before any metric is derived.

Times are `time.perf_counter()` seconds of the benchmark process. Every derived number (TTFT, ITL,
TPOT, ...) is computed from these records by kvflow/bench/metrics.py, and the records themselves go
into the JSON result, so any number can be recomputed by someone who disagrees with a definition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# role: a chunk carrying only the assistant role (chat streams start with one);
# content: a chunk carrying output text and/or tokens; usage: a final chunk with only usage.
ChunkKind = Literal["role", "content", "usage"]
# Where the output token count of a request came from, best first.
TokenCountSource = Literal["usage", "tokenize", "local"]


@dataclass
class ChunkEvent:
    time: float  # arrival of the SSE event (perf_counter seconds)
    kind: ChunkKind
    num_tokens: int  # output tokens the chunk carries (0 for role and usage chunks)
    text: str = ""


@dataclass
class RequestRecord:
    index: int  # position in the workload
    send_time: float  # just before the request is written (perf_counter seconds)
    prompt_tokens: int  # input length in the server's tokens (usage when given, else the workload's)
    chunks: list[ChunkEvent] = field(default_factory=list)
    end_time: float | None = None  # the end of the stream ([DONE] or connection close)
    output_tokens: int = 0
    token_count_source: TokenCountSource = "local"
    error: str | None = None  # HTTP status + message, or the exception; None when the request succeeded
    is_warmup: bool = False
    conversation: int | None = None  # multi-turn: which conversation and turn this request is
    turn: int | None = None
    language: str | None = None  # multilingual workload
    prompt_chars: int = 0  # characters of the prompt text (tokens per character, multilingual)
    # Leading prompt tokens already sent by an earlier request of the run (whole blocks of
    # PREFIX_BLOCK_TOKENS, as a prefix cache would find them); None without a tokenizer.
    shared_prefix_tokens: int | None = None
    output_text: str = ""
    # The server's own timings of the request when it streams them (llama-server's `timings`:
    # prompt_n, prompt_ms, predicted_n, predicted_ms, ...); None otherwise.
    server_timings: dict[str, Any] | None = None
    priority: int | None = None  # the `priority` field sent (--priority-mix); None: not sent
    # The x-request-id header sent: a kvflow server records the request under it (its dashboard's
    # request row), which is how `kvflow doctor --request` finds this request's story.
    x_request_id: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.error is None and self.end_time is not None

    @property
    def content_chunks(self) -> list[ChunkEvent]:
        return [c for c in self.chunks if c.kind == "content"]
