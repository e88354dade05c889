"""The proposer the engine consults after each step: it sets `request.spec_token_ids` for running
requests that can be speculated on; the scheduler verifies them in the next step.

Eligible requests are those whose target distribution the verifier reproduces exactly without the
sampler's history-dependent steps: no penalties (they would change between draft positions), no
logprobs (reported per position by the plain sampler only), and past min_tokens (no banned
tokens), no logit_bias (see `eligible`). Other requests decode one token per step as usual, in the
same batch.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvflow.config import SpeculativeConfig
from kvflow.request import Request
from kvflow.spec_decode.ngram_proposer import propose_ngram


def eligible(request: Request) -> bool:
    params = request.sampling_params
    return (
        not params.has_penalties
        and params.logprobs is None
        and request.num_output_tokens >= params.min_tokens
        # logit_bias changes the target distribution per row and the verifier does not apply it:
        # those requests decode one token per step (exact, unspeculated). Structured output is
        # eligible: the engine cuts drafts at the first token the grammar rejects, and the verifier
        # masks each verified position with the grammar's mask there (structured/manager.py).
        and not params.logit_bias
    )


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: Iterable[Request]) -> None:
        c = self.config
        for request in requests:
            request.spec_token_ids = []
            if not eligible(request) or request.num_computed_tokens != request.num_tokens - 1:
                continue
            max_tokens = request.sampling_params.max_tokens
            # A step emits at most k + 1 tokens: drafting past max_tokens is wasted work.
            remaining = (
                c.num_speculative_tokens if max_tokens is None else max_tokens - request.num_output_tokens - 1
            )
            k = min(c.num_speculative_tokens, remaining)
            if k > 0:
                request.spec_token_ids = propose_ngram(
                    request.all_token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max
                )
