"""Structured output's per-row allowed tokens applied to logits (vLLM v1's `apply_grammar_bitmask`).

bitmask [R, W] int32: bit b of word w set = token 32 * w + b allowed. Tokens at or past 32 * W (a
model vocabulary padded past the tokenizer's) are never allowed.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")
BITS_PER_WORD = 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> allowed [R, vocab_size] bool."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]; >> on int32 is arithmetic, & 1 fixes it
    allowed = bits.view(bitmask.shape[0], -1).bool()  # [R, 32 W]
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    padding = torch.zeros(bitmask.shape[0], vocab_size - width, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, padding], dim=1)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], v] = -inf where bitmask[i] does not allow v.

    logits [B, V] float32; rows [R] int64 (distinct); bitmask [R, W] int32."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [R, V]
    selected = logits.index_select(0, rows)  # [R, V] copy
    selected.masked_fill_(~allowed, _NEG_INF)
    logits.index_copy_(0, rows, selected)
