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

// Weight tiles one thread of a GEMV (gemv_bf16.cpp, gemv_int8.cpp, gemv_int4.cpp) streams side by
// side at `rows` activation rows per pass: as many as keep their accumulators (2 per row and tile)
// within 16 of the 32 zmm registers, at most 4. Why: one sequential stream per core leaves DRAM
// bandwidth unused on Intel server cores, whose L2 streamer runs ahead of each stream on its own.
// Measured on a 2-core AMX Xeon VM (benchmarks/NOTES.md, session 16): the bf16 tile loop
// at one row over 1 GiB, one stream 20.5 GB/s, two 28.7, four 31.3, against 29.1 for a plain sum;
// single-stream decode steps of the 0.5B shape, alternated, bf16 at 56% -> 94% of the roofline,
// int8 20.4-20.7 -> 17.7-17.8 ms. The int4 GEMV takes at most two (gemv_int4.cpp kInt4TileStreams).
// The AVX2 build has no registers to spare: one.
constexpr int64_t kTileStreams([[maybe_unused]] int64_t rows) {
#if defined(__AVX512F__)
  return rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
#else
  return 1;
#endif
}

}  // namespace kvflow
