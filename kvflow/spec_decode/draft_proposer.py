"""Draft-model proposer: a smaller checkpoint with the same vocabulary guesses k tokens per request,
batched across requests, with its own paged KV cache.

Per request the draft keeps the tokens it has fed (`fed`) and their K/V in its blocks. Each round:
  1. catch up: feed the request's tokens the draft has not seen (the prompt at first; afterwards
     the accepted drafts it already holds stay, only the target's extra token is new), found as
     the common prefix of `fed` and the request's tokens, so rejected guesses are simply dropped;
  2. k - 1 more single-token steps, feeding each guess back, all requests in one batch per step.
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
from kvflow.sample.sampler import filtered_probs
from kvflow.scheduler_output import ScheduledRequest, SchedulerOutput
from kvflow.spec_decode.proposer import eligible
from kvflow.worker.input_batch import build_input_batch
from kvflow.worker.model_runner import enable_batch_invariance


@dataclass
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # tokens whose draft K/V is in `blocks`


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
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

    # --------------------------------------------------------------------------------- blocks

    def _ensure_blocks(self, state: _DraftState, num_tokens: int) -> bool:
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        if needed > len(self.free_blocks):
            return False
        for _ in range(max(needed, 0)):
            state.blocks.append(self.free_blocks.pop())
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
            keep = _common_prefix(state.fed, request.all_token_ids)
            state.fed = state.fed[:keep]
            if keep == request.num_tokens:  # keep one token to feed: its logits give the first guess
                state.fed.pop()
            if k > 0 and self._ensure_blocks(state, request.num_tokens + k):
                chosen.append((request, state, k))
        if not chosen:
            return
        guesses: dict[str, list[int]] = {r.request_id: [] for r, _, _ in chosen}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in chosen}
        feeds = {r.request_id: list(r.all_token_ids[len(s.fed) :]) for r, s, _ in chosen}
        for step in range(max(k for _, _, k in chosen)):
            active = [(r, s) for r, s, k in chosen if step < k]
            logits = self._forward([(r, s, feeds[r.request_id]) for r, s in active])
            for (request, state), row in zip(active, logits, strict=True):
                token, q = self._guess(request, row)
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
                block_ids=state.blocks,
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

    def _guess(self, request: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        params = request.sampling_params
        if params.is_greedy:
            return int(logits.argmax()), None
        q = filtered_probs(logits[None].float(), [params])[0]
        return int(torch.multinomial(q, 1, generator=self.generator)), q
