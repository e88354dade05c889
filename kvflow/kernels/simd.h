// The SIMD intrinsics of kvflow's CPU kernels: include this instead of <immintrin.h>, after every
// system and torch header of the source.
//
// The kernels are written in AVX-512 intrinsics (16 fp32 lanes, __mmask16 lane masks, vdpbf16ps,
// vpdpbusd). Built with -mavx512* (kvflow/kernels/__init__.py picks the flags from the CPU), they
// compile to those instructions unchanged. Built for an AVX2 CPU (Zen 2/3, Intel client cores:
// no AVX-512), avx512_on_avx2.h supplies the same intrinsics over pairs of 256-bit registers, so
// the one source serves both and the kernel tests check both against torch.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX512F__)
#include "avx512_on_avx2.h"
#endif

namespace kvflow {

// Bytes between the software prefetches of a streamed weight matrix (gemv_int8.cpp, gemv_int4.cpp):
// every cache line. Every other line was enough on Zen 4 (the adjacent-line prefetcher fetched the
// pair), but not on Zen 3 (AVX2 build; one core, int8 inner loop over 256 MiB: 7.6-10 GB/s against
// 11-12 without software prefetch and 14-15.6 with every line) nor on Zen 5 (AVX-512 build;
// head-sized GEMV, 2 threads, two runs: int8 8 rows 13-28 -> 31-41 GB/s, int4 g32 8 rows 12-15 ->
// 18-28, one row within noise or better): benchmarks/NOTES.md, sessions 13 and 15.
constexpr int64_t kWeightPrefetchStride = 64;

}  // namespace kvflow
