"""Draft-model proposer: a smaller checkpoint with the same vocabulary guesses k tokens per request,
batched across requests, with its own paged KV cache.

Per request the draft keeps the tokens it has fed (`fed`) and their K/V in its blocks. Each round:
  1. catch up: feed the request's tokens the draft has not seen (the prompt at first; afterwards
     the accepted drafts it already holds stay, only the target's extra token is new), found as
     the common prefix of `fed` and the request's tokens, so rejected guesses are simply dropped;
  2. k - 1 more single-token steps, feeding each guess back, all requests in one batch per step.
Steps whose every feed is a few tokens (all but a prompt's first catch-up) are query rows, built
straight from each request's slot vector (input_batch.query_rows_metadata) rather than through a
SchedulerOutput and build_input_batch: a draft forward is a few hundred microseconds, so the
per-step bookkeeping is a large part of what speculation pays per guess.
Guesses are the draft's argmax for greedy requests, and draws from the draft's filtered
distribution q otherwise; q is kept on the request so that the verifier can apply the exact
rejection rule with it (kvflow/sample/rejection_sampler.py).
Blocks come from a private free list sized like the target's pool (in tokens); a request whose
blocks cannot be had gets no drafts this round. State of requests no longer running is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvflow.attention.kv_store import KVStore
from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.request import Request
from kvflow.sample.sampler import argmax_tokens, filtered_probs
from kvflow.scheduler_output import ScheduledRequest, SchedulerOutput
from kvflow.spec_decode.proposer import eligible
from kvflow.worker.input_batch import (
    MAX_QUERY_ROWS_PER_CHUNK,
    build_input_batch,
    query_rows_metadata,
    slot_vector,
)
from kvflow.worker.model_runner import enable_batch_invariance


@dataclass
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # tokens whose draft K/V is in `blocks`
    # fed[:confirmed] are the request's own tokens (checked last round). A request's tokens only
    # grow, so they stay so: the next round compares from here, not from 0.
    confirmed: int = 0
    # Slots of positions [0, len(blocks) * block_size), rebuilt when blocks are added.
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of a and b, given that a[:start] == b[:start]."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaFamilyForCausalLM,
        num_speculative_tokens: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        batch_invariant: bool = False,
    ) -> None:
        cfg = model.config
        self.model = model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.sliding_window = cfg.sliding_window
        self.max_model_len = max_model_len
        # +1: block 0 is the null block, as in the target's pool.
        self.kv_store = KVStore(
            cfg.num_hidden_layers,
            num_blocks + 1,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            model.dtype,
            latent=cfg.kv_latent,  # a latent-attention draft caches latents
        )
        # Batch-invariant mode: the drafts of a request, and so which random draws its verification
        # takes, must not depend on the batch either.
        self.batch_invariant = batch_invariant
        if batch_invariant:
            enable_batch_invariance(model, self.kv_store)
        self.free_blocks = list(range(num_blocks, 0, -1))
        self.states: dict[str, _DraftState] = {}
        self.generator = torch.Generator().manual_seed(0)
        # The model's native decoder is bound to self.kv_store (set by the factory unless eager):
        # query-row steps then go to it as plain lists (input_batch.DecodeRows), sliding window or not.
        self.native_decode = False

    # --------------------------------------------------------------------------------- blocks

    def _ensure_blocks(self, state: _DraftState, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        if needed > len(self.free_blocks):
            return False
        for _ in range(max(needed, 0)):
            state.blocks.append(self.free_blocks.pop())
        if needed > 0:
            state.slots = slot_vector(state.blocks, self.block_size)
        return True

    def _drop(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free_blocks.extend(reversed(state.blocks))

    # -------------------------------------------------------------------------------- propose

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request]) -> None:
        live = {r.request_id for r in requests}
        for rid in [rid for rid in self.states if rid not in live]:
            self._drop(rid)
        chosen: list[tuple[Request, _DraftState, int]] = []
        for request in requests:
            request.spec_token_ids, request.spec_draft_probs = [], None
            if not eligible(request) or request.num_computed_tokens != request.num_tokens - 1:
                continue
            params = request.sampling_params
            remaining = (
                self.k if params.max_tokens is None else params.max_tokens - request.num_output_tokens - 1
            )
            k = min(self.k, remaining, self.max_model_len - request.num_tokens - 1)
            state = self.states.setdefault(request.request_id, _DraftState())
            keep = _common_prefix(state.fed, request.all_token_ids, state.confirmed)
            del state.fed[keep:]
            if keep == request.num_tokens:  # keep one token to feed: its logits give the first guess
                state.fed.pop()
            state.confirmed = len(state.fed)
            if k > 0 and self._ensure_blocks(state, request.num_tokens + k):
                chosen.append((request, state, k))
        if not chosen:
            return
        guesses: dict[str, list[int]] = {r.request_id: [] for r, _, _ in chosen}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in chosen}
        feeds = {r.request_id: list(r.all_token_ids[len(s.fed) :]) for r, s, _ in chosen}
        for step in range(max(k for _, _, k in chosen)):
            active = [(r, s) for r, s, k in chosen if step < k]
            items = [(r, s, feeds[r.request_id]) for r, s in active]
            rows = all(len(f) <= MAX_QUERY_ROWS_PER_CHUNK for _, _, f in items)
            if rows and (self.native_decode or self.sliding_window is None):
                step_guesses = self._guess_from_hidden([r for r, _ in active], self._rows_forward(items))
            else:
                step_guesses = self._guess([r for r, _ in active], self._forward(items))
            for (request, state), (token, q) in zip(active, step_guesses, strict=True):
                state.fed.extend(feeds[request.request_id])
                feeds[request.request_id] = [token]
                guesses[request.request_id].append(token)
                if q is not None:
                    probs[request.request_id].append(q)
        for request, _, _ in chosen:
            request.spec_token_ids = guesses[request.request_id]
            if probs[request.request_id]:
                request.spec_draft_probs = torch.stack(probs[request.request_id])

    def _forward(self, items: list[tuple[Request, _DraftState, list[int]]]) -> torch.Tensor:
        """Feed each request's tokens at its next positions; logits of each one's last token [B, V]."""
        scheduled = [
            ScheduledRequest(
                request_id=request.request_id,
                token_ids=tokens,
                num_computed_tokens=len(state.fed),
                block_ids=[state.blocks],
                do_sample=True,
                is_decode=len(tokens) == 1,
                sampling_params=request.sampling_params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
            )
            for request, state, tokens in items
        ]
        batch = build_input_batch(
            SchedulerOutput(scheduled, sum(len(t) for _, _, t in items)),
            self.block_size,
            self.model.config.sliding_window,
            all_query_rows=self.batch_invariant,
        )
        hidden = self.model(batch.input_ids, batch.attn_metadata, self.kv_store)
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        # build_input_batch puts single-token requests first: map rows back to `items` order.
        order = {r.request_id: i for i, r in enumerate(batch.sampling_requests)}
        return logits[[order[request.request_id] for request, _, _ in items]]

    def _rows_forward(self, items: list[tuple[Request, _DraftState, list[int]]]) -> torch.Tensor:
        """_forward for feeds that are query rows only: each one's last hidden state [B, hidden]. The
        native decoder takes them as lists (positions and block tables); the Python path needs no
        sliding window and reads each request's slot vector."""
        if self.native_decode:
            token_ids = [t for _, _, tokens in items for t in tokens]
            positions = [p for _, s, tokens in items for p in range(len(s.fed), len(s.fed) + len(tokens))]
            tables = [state.blocks for _, state, tokens in items for _ in tokens]
            hidden = self.model.forward_decode_rows(token_ids, positions, tables)  # [R, hidden]
        else:
            rows = [(state.slots, len(state.fed), len(tokens)) for _, state, tokens in items]
            input_ids = torch.tensor([t for _, _, tokens in items for t in tokens], dtype=torch.int64)
            hidden = self.model(input_ids, query_rows_metadata(rows), self.kv_store)  # [R, hidden]
        if hidden.shape[0] > len(items):  # some request fed several tokens: keep each one's last row
            last = torch.tensor([len(tokens) for _, _, tokens in items]).cumsum(0) - 1
            hidden = hidden.index_select(0, last)
        return hidden

    def _guess_from_hidden(
        self, requests: list[Request], hidden: torch.Tensor
    ) -> list[tuple[int, torch.Tensor | None]]:
        """_guess from each request's last hidden state [B, hidden]: all-greedy batches take the
        argmax inside the LM head's GEMV where the head is native (no logits are read back)."""
        if all(r.sampling_params.is_greedy for r in requests):
            tokens = self.model.greedy_tokens(hidden)
            if tokens is not None:
                return [(token, None) for token in tokens.tolist()]
        return self._guess(requests, self.model.compute_logits(hidden))  # the model's dtype

    def _guess(self, requests: list[Request], logits: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        """Each request's guess from its logits row [B, V], with q for a sampled one (None: greedy)."""
        greedy = argmax_tokens(logits).tolist()  # one native call for the batch's greedy rows
        guesses: list[tuple[int, torch.Tensor | None]] = []
        for request, row, best in zip(requests, logits, greedy, strict=True):
            params = request.sampling_params
            if params.is_greedy:
                guesses.append((best, None))
                continue
            q = filtered_probs(row[None].float(), [params])[0]
            guesses.append((int(torch.multinomial(q, 1, generator=self.generator)), q))
        return guesses
