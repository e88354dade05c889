"""Turns scheduler updates into `RequestOutput`s: detokenization, stop strings, logprobs.

Stop strings are found here, on text, after the scheduler has appended the tokens; the engine
then finishes the request in the scheduler (as vLLM v1 does). The token ids keep the token that
completed the stop string; the text is cut before it (or after, with include_stop_str_in_output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.engine.scheduler import RequestUpdate
from kvflow.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from kvflow.request import Request
from kvflow.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float | None
    sent_token_count: int = 0
    pending_token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        want_logprobs = params.logprobs is not None
        self.states[request.request_id] = RequestState(
            request, detok, [] if want_logprobs else None, 0.0 if want_logprobs else None
        )

    def _decode_logprobs(self, position: TokenLogprobs) -> TokenLogprobs:
        return {
            tok: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([tok], skip_special_tokens=False))
            for tok, lp in position.items()
        }

    def add_prompt_logprobs(self, request: Request, first: int, entries: list[TokenLogprobs]) -> None:
        """Store a chunk's prompt logprobs (worker/prompt_logprobs.py), decoded, at positions first..;
        positions already held (a preempted request's recompute) keep their first value."""
        held = request.prompt_logprobs
        if held is None:
            return
        new = entries[len(held) - first :] if first <= len(held) else []
        held.extend(self._decode_logprobs(entry) for entry in new)

    def _add_logprobs(self, state: RequestState, new_ids: list[int], logprobs: list[TokenLogprobs]) -> None:
        if state.logprobs is None or state.cumulative_logprob is None:
            return
        for tok, position in zip(new_ids, logprobs, strict=False):
            state.logprobs.append(self._decode_logprobs(position))
            state.cumulative_logprob += position[tok].logprob

    def process(
        self, update: RequestUpdate, logprobs: list[TokenLogprobs] | None
    ) -> tuple[RequestOutput | None, str | None]:
        """Returns the output to emit and a stop string if one was found (the caller finishes the
        request in the scheduler, then calls `finish` to emit the final output)."""
        state = self.states.get(update.request.request_id)
        if state is None:
            return None, None
        if logprobs:
            self._add_logprobs(state, update.new_token_ids, logprobs)
        stop_str = state.detokenizer.update(update.new_token_ids) if update.new_token_ids else None
        if stop_str is not None:
            return None, stop_str
        return self.make_output(state), None

    def make_output(self, state: RequestState, error: str | None = None) -> RequestOutput:
        req = state.request
        finished = req.is_finished
        delta_text = state.detokenizer.get_next_output_text(finished, delta=True)
        delta_ids = req.output_token_ids[state.sent_token_count :]
        delta_logprobs = None
        if state.logprobs is not None:  # one entry per output token, in step with output_token_ids
            delta_logprobs = state.logprobs[state.sent_token_count : req.num_output_tokens]
        state.sent_token_count = req.num_output_tokens
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.output_text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
        )
        if finished:
            del self.states[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=req.timeline,
            num_cached_tokens=req.timeline.num_cached_prompt_tokens,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            delta_logprobs=delta_logprobs,
            prompt_logprobs=req.prompt_logprobs,
            error=error,
        )

    def finish(self, request: Request, error: str | None = None) -> RequestOutput | None:
        """Final output of a request finished outside `process` (stop string, abort, failure)."""
        state = self.states.get(request.request_id)
        if state is None:
            return None
        assert request.status.is_finished, request
        return self.make_output(state, error)
