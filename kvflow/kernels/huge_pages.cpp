// Buffers on 2 MiB transparent huge pages, for the weights decode streams and the KV pools it reads.
//
// Why: a decode step reads every weight once (988 MB for Qwen2.5-0.5B in bf16). On 4 KiB pages
// that is ~250k TLB misses per token, each a page walk the GEMV's prefetches wait on; on 2 MiB pages
// it is ~500. Linux gives a process huge pages where it asks for them (THP "madvise", a common
// default) or everywhere ("always"); torch's CPU allocator asks only when THP_MEM_ALLOC_ENABLE=1 is
// set before its first allocation, which a library imported after torch cannot arrange. Measured on
// this project's machine, single-stream bf16 decode on the 0.5B shape: +5-7% tokens/s
// (benchmarks/NOTES.md, session 7).
//
// How: the buffer is 2 MiB-aligned and a multiple of 2 MiB, and marked MADV_HUGEPAGE before any
// page of it is touched, so its first-touch faults map huge pages (when THP is "never", or no huge
// page is free, the kernel maps ordinary pages: same contents, same speed as before). Freed with
// free() when the tensor's storage dies.

#include <sys/mman.h>
#include <ATen/ops/from_blob.h>
#include "aten_lite.h"

#include <cstdlib>
#include <new>

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
}  // namespace

// An uninitialised [nbytes] uint8 tensor on huge pages (the caller fills or zeroes it).
at::Tensor empty_huge_pages(int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "nbytes must be positive");
  const size_t rounded = (size_t(nbytes) + kHugePage - 1) / kHugePage * kHugePage;
  void* p = nullptr;
  if (posix_memalign(&p, kHugePage, rounded) != 0) throw std::bad_alloc();
  madvise(p, rounded, MADV_HUGEPAGE);  // advice only: an error (THP compiled out) leaves small pages
  return at::from_blob(p, {nbytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}
