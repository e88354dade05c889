"""Prompt logprobs (vLLM's `prompt_logprobs`; completions' `echo` with `logprobs`): for each prompt
token after the first, its logprob and the top-n under the model given the tokens before it.

The hidden state at position p scores the token at p + 1, so a chunk covering positions [s, e) of a
P-token prompt yields the entries of prompt positions s + 1 .. min(e, P - 1). Entries are computed as
the chunks are, whatever the chunking; the scheduler computes every prompt position of such a
request (no prefix-cache hit skips one), and the engine keeps the first value of a position that
preemption recomputes. Logits are taken `MAX_ROWS` positions at a time: a whole 2k-token chunk at
once would hold 2k x 151k float32 logits (1.2 GB).
"""

from __future__ import annotations

import torch

from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.outputs import TokenLogprobs
from kvflow.sample.sampler import gather_logprobs
from kvflow.scheduler_output import ScheduledRequest

MAX_ROWS = 256


def compute_prompt_logprobs(
    model: LlamaFamilyForCausalLM, requests: list[ScheduledRequest], hidden: torch.Tensor
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """request id -> (first prompt position covered, one entry per position) for this step's chunks.

    hidden [T, H]: the step's flat hidden states, `requests` in flat-batch order."""
    result: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    offset = 0
    for req in requests:
        token_start, offset = offset, offset + req.num_tokens
        num_top = req.sampling_params.prompt_logprobs
        if num_top is None:
            continue
        first = req.num_computed_tokens
        last = min(first + req.num_tokens, len(req.prompt_token_ids) - 1)  # positions scoring a prompt token
        if last <= first:
            continue
        rows = torch.arange(token_start, token_start + last - first, dtype=torch.int64)  # [L]
        targets = torch.tensor(req.prompt_token_ids[first + 1 : last + 1], dtype=torch.int64)  # [L]
        entries: list[TokenLogprobs] = []
        for piece in range(0, len(rows), MAX_ROWS):
            logits = model.compute_logits(hidden.index_select(0, rows[piece : piece + MAX_ROWS]))  # [l, V]
            raw = torch.log_softmax(logits.float(), dim=-1)
            chunk_targets = targets[piece : piece + MAX_ROWS]
            entries += gather_logprobs(raw, chunk_targets, [num_top] * len(chunk_targets))
        result[req.request_id] = (first + 1, entries)
    return result
