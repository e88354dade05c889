"""The short causal depthwise convolution of linear-attention layers (Qwen3-Next's Gated DeltaNet),
carrying its state across prefill chunks and decode steps.

Shapes: T tokens of one request's chunk, B decode requests, C channels (conv_dim = 2 x key_dim +
value_dim: q, k and v are convolved together), K = kernel size (4 in Qwen3-Next).
Each channel c has its own K taps (depthwise), causal over the token axis:
    out[t, c] = silu(bias[c] + Σ_{i<K} weight[c, i] · x[t - (K-1) + i, c])
so a token needs the K-1 inputs before it. The state is exactly those inputs, raw (before the
convolution) and in the input dtype: conv_state [C, K-1], column K-2 the newest. A fresh request's
state is zeros, which is the left zero-padding of HF's causal_conv1d_fn. HF's cache keeps K columns
(its oldest column is never read: a step convolves K+1 inputs and keeps the last output); kvflow keeps
the K-1 that are read.
The arithmetic is HF's: F.conv1d with groups=C in the weight's dtype, then silu, then the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _conv_silu(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """window [N, C, L] (L >= K) -> silu(depthwise causal conv) [N, C, L - K + 1], in the weight's dtype."""
    out = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out)


def _with_state(x: torch.Tensor, conv_state: torch.Tensor | None, state_len: int) -> torch.Tensor:
    """x [T, C], conv_state [C, K-1] or None (zeros) -> [C, K-1 + T]: the state's inputs, then the chunk's."""
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[1], state_len)
    return torch.cat((conv_state.to(x.dtype), x.t()), dim=1)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's chunk: x [T, C], weight [C, K], conv_state [C, K-1] (None: a fresh request)
    -> (out [T, C] in x's dtype, new conv_state [C, K-1] = the last K-1 inputs of [state | x], so for
    T < K-1 it still holds the newest K-1-T columns of the old state)."""
    state_len = weight.shape[1] - 1
    full = _with_state(x, conv_state, state_len)  # [C, K-1 + T]
    out = _conv_silu(full.unsqueeze(0), weight, bias)[0]  # [C, T]
    return out.t().to(x.dtype).contiguous(), full[:, full.shape[1] - state_len :].contiguous()


def conv_state_after(x: torch.Tensor, conv_state: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The conv state after the first `num_tokens` tokens of the chunk x [T, C] (0 <= num_tokens <= T),
    for a prefix-cache checkpoint: the K-1 inputs ending at token num_tokens - 1, [C, K-1].
    conv_state [C, K-1] is the chunk's incoming state (zeros for a fresh request)."""
    if not 0 <= num_tokens <= x.shape[0]:
        raise ValueError(f"num_tokens must be in [0, {x.shape[0]}], got {num_tokens}")
    state_len = conv_state.shape[1]
    # Only the last K-1 tokens before the checkpoint are read, so the concatenation stays K-1 + K-1 wide.
    head = x[max(0, num_tokens - state_len) : num_tokens]
    full = _with_state(head, conv_state, state_len)
    return full[:, full.shape[1] - state_len :].contiguous()


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests: x [B, C], weight [C, K], conv_state [B, C, K-1]
    -> (out [B, C] in x's dtype, new conv_state [B, C, K-1]: the old one shifted left by one, x last)."""
    window = torch.cat((conv_state.to(x.dtype), x.unsqueeze(2)), dim=2)  # [B, C, K]
    out = _conv_silu(window, weight, bias)[:, :, 0]  # [B, C]: one output per window
    return out.to(x.dtype), window[:, :, 1:].contiguous()
