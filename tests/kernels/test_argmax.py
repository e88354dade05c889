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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_argmax_one_row_split_over_threads(dtype: torch.dtype) -> None:
    """A lone row is split into column spans, one per thread: the first index must still win across
    the spans' boundary (a tie in both halves, a NaN only in the second, the maximum in the last
    lane), whatever the thread count."""
    kernel = argmax_rows()
    if kernel is None:
        pytest.skip("native kernels unavailable on this CPU/toolchain")
    vocab = 151936
    gen = torch.Generator().manual_seed(1)
    cases = []
    for where in ([10, vocab - 5], [vocab // 2 - 1, vocab // 2], [vocab // 2, vocab - 1], [vocab - 1]):
        row = torch.randn(1, vocab, generator=gen)
        row[0, where] = row.max() + 1
        cases.append(row)
    nan_late = torch.randn(1, vocab, generator=gen)
    nan_late[0, vocab - 3] = float("nan")
    cases += [nan_late, torch.full((1, vocab), float("-inf")), torch.zeros(1, vocab)]
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            for row in cases:
                row = row.to(dtype)
                assert torch.equal(kernel(row), row.float().argmax(dim=-1)), num_threads
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
def test_greedy_gemv_gives_the_argmax_of_its_outputs(rows: int) -> None:
    """The LM head's greedy GEMV folds its outputs into each row's argmax every few tiles, per
    thread: whatever the thread count and the fold and thread boundaries (N not a multiple of the
    16-row tile; rows past a pass of 8 and past max_gemv_rows), its tokens are the argmax of the
    plain GEMV's outputs, first index on ties."""
    from kvflow.kernels import native_decoder_classes
    from kvflow.layers.linear import Linear

    classes = native_decoder_classes()
    if classes is None:
        pytest.skip("native kernels unavailable on this CPU/toolchain")
    gen = torch.Generator().manual_seed(rows)
    head = Linear(128, 3001, False, torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(3001, 128, generator=gen).to(torch.bfloat16))
        head.weight[2999] = head.weight[17]  # equal outputs at columns 17 and 2999: the first wins
    x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
    x[0] = head.weight[17].float().sign().to(torch.bfloat16)  # row 0's maximum: column 17 (and 2999)
    head.prepare_for_inference()  # the weights move into the GEMV's tiles
    native = head.native(classes)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            with torch.inference_mode():
                tokens = native.greedy(x)
                assert torch.equal(tokens, native.forward(x).float().argmax(dim=-1)), num_threads
                assert tokens[0] == 17  # the tie went to the first column
    finally:
        torch.set_num_threads(threads)
