"""The native greedy argmax gives torch.argmax's answer: the first index of the maximum, a NaN
counting as the maximum, rows whose length is not a multiple of the vector width."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 17, 151936])
def test_native_argmax_equals_torch(vocab: int, dtype: torch.dtype) -> None:
    """bf16 rows too: greedy sampling takes the argmax of the LM head's bf16 output directly, and it
    must be the argmax of the float32 copy it no longer makes."""
    kernel = argmax_rows()
    if kernel is None:
        pytest.skip("native kernels unavailable on this CPU/toolchain")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen)
    logits[1] = float("-inf")  # every entry equal: index 0
    if vocab > 10:
        logits[2, 3] = logits[2, vocab - 1] = logits[2].max() + 1  # a tie: the first wins
        logits[3, vocab - 1] = logits[3].max() + 1  # in the vector tail
        logits[4, 9] = logits[4, 5] = float("nan")  # the first NaN
        logits[5] = torch.randn(vocab, generator=gen).to(torch.bfloat16).float()  # bf16 values: many ties
    logits = logits.to(dtype)
    assert torch.equal(kernel(logits), logits.argmax(dim=-1))
    assert torch.equal(kernel(logits), logits.float().argmax(dim=-1))
