"""The layers tensor parallelism adds around the model's own (vLLM's names).

Column-parallel layers need no layer of their own: a rank's q/k/v and gate/up are plain (or
quantized) linears over its output rows, built at the per-rank size (sharding.py). The others:
- RowParallelLinear: o_proj and down_proj over this rank's input columns; the partial outputs are
  all-reduced (their bias is on rank 0 only, so it is added once).
- VocabParallelEmbedding: this rank's vocabulary rows; tokens outside them look up zeros, and the
  all-reduce of [T, hidden] fills every row from the rank that holds it (exact: x + 0 = x).
- ParallelLMHead: this rank's vocabulary rows of the head; rank 0 gathers the parts into the whole
  [N, V] logits (only the rows that are sampled: the runner passes only those).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import NativeDecoderClasses
from kvflow.parallel.communicator import Communicator


class RowParallelLinear(nn.Module):
    # The native decode forward must all-reduce this layer's output (kvflow/models/native_decoder.py).
    all_reduce_after = True

    def __init__(self, linear: nn.Module, comm: Communicator) -> None:
        super().__init__()
        self.linear = linear  # quantize_model swaps this child too (it is a Linear until then)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / N] -> [T, out], summed over ranks
        return self.comm.all_reduce(self.linear(x))

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        """The local part for the native decode forward, which all-reduces its output itself."""
        native = getattr(self.linear, "native", None)
        return None if native is None else native(classes)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, vocab_start: int, comm: Communicator) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V / N (padded), hidden]
        self.vocab_start = vocab_start
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        hidden = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        hidden = hidden.masked_fill(~inside.unsqueeze(-1), 0)
        return self.comm.all_reduce(hidden)


class ParallelLMHead(nn.Module):
    def __init__(self, lm_head: nn.Module, vocab_size: int, comm: Communicator) -> None:
        super().__init__()
        # Named lm_head so that quantize_model treats it as the LM head (quantized only if asked).
        self.lm_head = lm_head
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> rank 0: the whole logits [R, V] (float32); other ranks: their part."""
        part = self.lm_head(hidden)  # [R, V / N] in the model dtype: what TP=1 upcasts, half the bytes
        logits = self.comm.gather(part)
        return part.float() if logits is None else logits[:, : self.vocab_size].float()
