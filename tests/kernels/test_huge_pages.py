"""Buffers on transparent huge pages (kvflow/kernels/huge_pages.cpp): same values, dtype and shape as
the tensor copied, 2 MiB-aligned, small tensors left where they are, and freed with their storage."""

from __future__ import annotations

import gc

import pytest
import torch

from kvflow.kernels import HUGE_PAGE_MIN_BYTES, native_build, on_huge_pages, zeros_on_huge_pages

HUGE_PAGE = 2 << 20

pytestmark = pytest.mark.skipif(native_build().module is None, reason="native kernels unavailable here")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float32])
def test_a_large_tensor_is_copied_exactly_onto_an_aligned_buffer(dtype: torch.dtype) -> None:
    source = (torch.randn(1025, 2049) * 50).to(dtype)  # 2.1-8.4 MB, not a multiple of 2 MiB
    assert source.numel() * source.element_size() >= HUGE_PAGE_MIN_BYTES
    copy = on_huge_pages(source)
    assert copy.dtype == dtype and copy.shape == source.shape and copy.is_contiguous()
    assert torch.equal(copy, source)
    assert copy.data_ptr() != source.data_ptr() and copy.data_ptr() % HUGE_PAGE == 0
    copy.add_(1)  # writable, and independent of the source
    assert not torch.equal(copy, source)


def test_small_or_strided_tensors_are_returned_as_they_are() -> None:
    small = torch.ones(16, 16)
    assert on_huge_pages(small) is small
    strided = torch.ones(2048, 2048).t()
    assert on_huge_pages(strided) is strided


def test_zeros_on_huge_pages_are_zeros_and_are_freed() -> None:
    shape = (4096, 2, 128)  # 2 MiB of bf16 plus the rounding
    for _ in range(3):  # allocate and drop repeatedly: each buffer is freed with its storage
        pool = zeros_on_huge_pages(shape, torch.bfloat16)
        assert pool.shape == shape and pool.dtype == torch.bfloat16 and not pool.any()
        assert pool.data_ptr() % HUGE_PAGE == 0
        pool.fill_(1)
        del pool
        gc.collect()
    assert torch.equal(zeros_on_huge_pages((3, 4), torch.float32), torch.zeros(3, 4))
