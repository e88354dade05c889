"""StructuredOutputManager: compile off the engine thread, cache by grammar, fill masks, advance.

Lifecycle of a constrained request (all calls from the engine thread unless noted):
  validate / prepare     any thread: build + validate the grammar, against the tokenizer too
                         (InvalidRequestError -> HTTP 400)
  submit(request)        status WAITING_FOR_GRAMMAR; its compile is queued in the compile thread,
                         or found in the cache (one compile per distinct grammar, even concurrent)
  poll(request)          at the start of each step: once compiled, the request gets its own matcher
                         (a copy of the cached one), `timeline.grammar_compile_time`, and is WAITING
                         again: the scheduler skips it until then, and schedules everyone else
  fill_bitmask(...)      after schedule(): the constrained rows' allowed tokens, filled in the mask
                         thread while the model runs the forward pass; the runner waits for it only
                         right before sampling
  accept(request, ids)   after the step: the matcher advances on the request's new output tokens
With a reasoning parser (`--reasoning-parser`), a request's ReasoningGate (reasoning_gate.py) holds
its grammar back while the output is inside the reasoning: no mask, nothing consumed, until
`</think>`; the grammar then starts on the tokens after it.

The matcher only ever sees output tokens, and a request keeps its outputs through preemption
(recompute re-prefills prompt + outputs, then samples the next token), chunked prefill (no sampling
until the last chunk) and prefix hits (KV reuse only): its state needs no rollback in any of them.
Speculative decoding: `check_drafts` cuts a constrained request's drafts at the first token its
grammar rejects (a rejected draft could only be refused by the verifier anyway); the step then fills
1 + k masks for it, the grammar's mask after each accepted-draft prefix (the matcher consumes the
drafts and rolls them back), and the verifier masks each of its k + 1 target rows with them, so the
accept/reject rule sees exactly the distributions plain decoding would sample from.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from kvflow.errors import InvalidRequestError
from kvflow.reasoning import ReasoningParser
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.scheduler_output import GrammarBitmask, SchedulerOutput
from kvflow.structured.backend import GrammarBackend
from kvflow.structured.grammar_spec import GrammarSpec, build_grammar
from kvflow.structured.reasoning_gate import ReasoningGate, ReasoningMarkers
from kvflow.tokenizer import Tokenizer

# Distinct compiled grammars kept (least recently used dropped first). A template is a few hundred KB
# at most for large schemas; 256 covers a server's recurring schemas and tool sets.
MAX_CACHED_GRAMMARS = 256
Work = tuple[llguidance.LLMatcher, list[int], int | None]  # a row group of fill_bitmask (see _fill)


class RequestGrammar:
    """One request's structured-output state (held in `request.structured_state`)."""

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec
        self.compiled: Future[llguidance.LLMatcher] | None = None
        self.matcher: llguidance.LLMatcher | None = None
        self.submit_time: float | None = None
        self.gate: ReasoningGate | None = None  # with a reasoning parser

    @property
    def is_terminated(self) -> bool:
        """The grammar allows nothing more (not even optional text): the output is complete."""
        return self.matcher is not None and self.matcher.is_stopped()


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, reasoning: ReasoningParser | None = None) -> None:
        self._tokenizer = tokenizer
        self._markers = None if reasoning is None else ReasoningMarkers.encode(reasoning, tokenizer)
        # One compile thread: compiles are milliseconds, and the engine thread must keep a core.
        self._compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-grammar")
        self._fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvflow-bitmask")
        self._backend: Future[GrammarBackend] | None = None
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._pending: dict[str, Request] = {}  # WAITING_FOR_GRAMMAR, by request id
        # Grammars already validated against the tokenizer (request threads read and add; the lock
        # also guards the backend's creation, which any thread may start).
        self._validated: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------- admission

    def validate(self, params: StructuredOutputsParams, field: str | None = None) -> GrammarSpec:
        """Any thread. The grammar, checked as the compile thread will build it: shape and syntax
        first, then against the tokenizer (special tokens and token ids a grammar names must exist),
        once per distinct grammar. Raises InvalidRequestError("<field>: <reason>"). The first call
        waits for the tokenizer's setup (~0.7 s for a 151k vocabulary, once per engine)."""
        spec = build_grammar(params, field)
        with self._lock:
            if spec.grammar in self._validated:
                self._validated.move_to_end(spec.grammar)
                return spec
        tokenizer = self._backend_future().result().tokenizer
        error = llguidance.LLMatcher.validate_grammar(spec.grammar, tokenizer)
        if error:
            raise InvalidRequestError(f"{spec.field}: {error.strip()}")
        with self._lock:
            self._validated[spec.grammar] = None
            while len(self._validated) > MAX_CACHED_GRAMMARS:
                self._validated.popitem(last=False)
        return spec

    def prepare(self, params: SamplingParams) -> RequestGrammar | None:
        """Any thread. None for an unconstrained request; raises InvalidRequestError for a bad one."""
        if params.structured_outputs is None:
            return None
        return RequestGrammar(self.validate(params.structured_outputs))

    def submit(self, request: Request) -> None:
        """Queue the request's compile (or find it cached); the request waits in WAITING_FOR_GRAMMAR."""
        state: RequestGrammar = request.structured_state
        state.submit_time = time.monotonic()
        state.compiled = self._compiled(state.spec)
        if self._markers is not None:
            state.gate = ReasoningGate.for_prompt(self._markers, self._tokenizer, request.prompt_token_ids)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._pending[request.request_id] = request

    def _compiled(self, spec: GrammarSpec) -> Future[llguidance.LLMatcher]:
        future = self._cache.get(spec.grammar)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(spec.grammar)
            return future
        backend = self._backend_future()
        future = self._compile_pool.submit(lambda: backend.result().compile(spec))
        self._cache[spec.grammar] = future
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def _backend_future(self) -> Future[GrammarBackend]:
        with self._lock:
            if self._backend is None:
                tok = self._tokenizer
                self._backend = self._compile_pool.submit(
                    lambda: GrammarBackend(tok.backend.to_str(), tok.eos_token_ids)
                )
            return self._backend

    # ------------------------------------------------------------------------------- readiness

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def poll(self) -> list[tuple[Request, str]]:
        """Move compiled requests back to WAITING. Returns (request, error) for failed compiles: the
        engine finishes those (aborted, with the error); the others go on untouched."""
        failed: list[tuple[Request, str]] = []
        for rid, request in list(self._pending.items()):
            state: RequestGrammar = request.structured_state
            assert state.compiled is not None
            if not state.compiled.done():
                continue
            del self._pending[rid]
            if request.status is not RequestStatus.WAITING_FOR_GRAMMAR:
                continue  # finished (aborted) while it waited
            try:
                state.matcher = state.compiled.result().deep_copy()
            except Exception as exc:  # InvalidRequestError from compile, or llguidance itself
                failed.append((request, f"grammar compilation failed: {exc}"))
                continue
            assert state.submit_time is not None
            request.timeline.grammar_compile_time = time.monotonic() - state.submit_time
            request.status = RequestStatus.WAITING
        return failed

    def wait_for_compile(self, timeout: float) -> None:
        """Block until some pending compile finishes (or `timeout` s): for an engine with nothing else
        to run, instead of spinning through empty steps."""
        futures = [r.structured_state.compiled for r in self._pending.values()]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    # ---------------------------------------------------------------------------------- per step

    def fill_bitmask(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> GrammarBitmask | None:
        """The allowed tokens of every constrained row that samples this step, filled in the mask
        thread. None when no such row. The matchers must not be touched until the result is waited for."""
        rows: dict[str, int] = {}
        work: list[Work] = []  # (matcher, drafts, a token allowed beside the grammar's), 1 + k rows each
        num_rows = 0
        for scheduled in scheduler_output.scheduled:
            request = requests.get(scheduled.request_id)
            if not scheduled.do_sample or request is None or request.structured_state is None:
                continue
            gate: ReasoningGate | None = request.structured_state.gate
            if gate is not None and gate.holds:
                continue  # inside the reasoning: unconstrained
            matcher = request.structured_state.matcher
            assert matcher is not None, "a constrained request was scheduled before its grammar was ready"
            drafts = scheduled.token_ids[len(scheduled.token_ids) - scheduled.num_spec_tokens :]
            rows[scheduled.request_id] = num_rows
            num_rows += 1 + len(drafts)
            work.append((matcher, drafts, None if gate is None else gate.extra_token))
        if not work:
            return None
        assert self._backend is not None and self._backend.done()
        width = self._backend.result().bitmask_width
        future = self._fill_pool.submit(_fill, work, num_rows, width)
        return GrammarBitmask(rows=rows, future=future)

    @staticmethod
    def check_drafts(requests: list[Request]) -> None:
        """Cut each constrained request's drafts (`spec_token_ids`, and `spec_draft_probs` rows with
        them) at the first token its grammar would reject."""
        for request in requests:
            state: RequestGrammar | None = request.structured_state
            if state is None or state.matcher is None or not request.spec_token_ids:
                continue
            if state.gate is not None and state.gate.phase != "constrained":
                continue  # the reasoning is free; its drafts go to the verifier as they are
            num_valid = state.matcher.try_consume_tokens(request.spec_token_ids)
            if num_valid:
                state.matcher.rollback(num_valid)
            if num_valid < len(request.spec_token_ids):
                request.spec_token_ids = request.spec_token_ids[:num_valid]
                if request.spec_draft_probs is not None:
                    request.spec_draft_probs = request.spec_draft_probs[:num_valid] if num_valid else None

    @staticmethod
    def accept(request: Request, token_ids: list[int]) -> str | None:
        """Advance the request's matcher; returns an error when a token breaks the grammar (possible
        only if something outside the mask chose it, e.g. a stop token id), else None."""
        state: RequestGrammar = request.structured_state
        matcher = state.matcher
        if matcher is None:
            return None
        if state.gate is not None:
            token_ids = state.gate.feed(token_ids)
            if not token_ids:
                return None
        if not matcher.consume_tokens(token_ids):
            return f"token(s) {token_ids} violate the grammar: {matcher.get_error()}"
        return None

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)


def _fill(work: list[Work], num_rows: int, width: int) -> Any:
    """[num_rows, width] int32 (bit set = allowed): per (matcher, drafts, extra), 1 + len(drafts) rows:
    the mask now (with `extra` allowed too), then after each draft (consumed, then rolled back: the
    matcher ends where it started)."""
    bitmask = np.empty((num_rows, width), dtype=np.int32)
    row = 0
    for matcher, drafts, extra in work:
        llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)
        if extra is not None:
            bitmask.view(np.uint32)[row, extra // 32] |= np.uint32(1 << (extra % 32))
        for draft in drafts:
            row += 1
            if not matcher.consume_token(draft):  # check_drafts kept only valid drafts
                raise RuntimeError(f"draft token {draft} broke the grammar: {matcher.get_error()}")
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, row)
        if drafts:
            matcher.rollback(len(drafts))
        row += 1
    return bitmask
