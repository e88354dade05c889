// The plain-layout decode GEMV (gemv_int8.cpp; bf16 and int4 moved to 16-row tiles, see their
// files): the loop over output rows and blocks of activation rows, and the streamed dot product of
// one weight row.
// Note: torch's JIT builder hashes the .cpp sources, not headers: after editing this file, touch
// a .cpp (or clear ~/.cache/kvflow/kernels) to force a rebuild.
#pragma once

#include <immintrin.h>

#include "bf16_utils.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace kvflow::gemv {

constexpr int64_t kMaxM = 4;    // activation rows per pass over a weight row
constexpr int64_t kLanes = 32;  // bf16 elements per 512-bit register
constexpr int64_t kUnroll = 4;  // independent accumulators per activation row

inline __mmask32 tail_mask(int64_t left) { return left >= kLanes ? ~__mmask32(0) : (__mmask32(1) << left) - 1; }

inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask = ~__mmask32(0)) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

template <int64_t MB>
using Rows = std::integral_constant<int64_t, MB>;

// Rows [n_begin, n_end) of y [M, N] bf16: for each output row n and block of up to kMaxM
// activation rows from m0, row_dot(n, Rows<MB>{}, m0, out) fills out[0..MB) with the dot
// products; y[m0 + i, n] = bf16(finish(n, out[i])) (scale, bias).
template <typename RowDot, typename Finish>
inline void gemv_rows(int64_t M, int64_t N, int64_t n_begin, int64_t n_end, const RowDot& row_dot,
                      const Finish& finish, uint16_t* y) {
  float out[kMaxM];
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const int64_t mb = std::min(kMaxM, M - m0);
      switch (mb) {
        case 1: row_dot(n, Rows<1>{}, m0, out); break;
        case 2: row_dot(n, Rows<2>{}, m0, out); break;
        case 3: row_dot(n, Rows<3>{}, m0, out); break;
        default: row_dot(n, Rows<4>{}, m0, out); break;
      }
      for (int64_t m = 0; m < mb; ++m) y[(m0 + m) * N + n] = float_to_bf16(finish(n, out[m]));
    }
  }
}

// out[m] = <weight row, x[m]> for MB rows of x ([MB, K] bf16, row stride K). The row is read
// through `w`, one per weight format:
//   w.chunk(k)         32 weights from k as bf16 (k + 32 <= K)
//   w.tail(k, left)    the last `left` (< 32 possible) weights from k, zero-padded
//   w.prefetch(k)      the cache lines some way ahead of the kUnroll chunks from k
// The row is read front to back, so a thread's share of W is one sequential stream (the hardware
// prefetcher follows one stream far better than several interleaved ones: measured 2x), and
// each chunk serves all MB rows of x. kUnroll accumulators per row hide the dot-product latency.
// Batch invariance: a row of x is accumulated in the same order whatever MB and M are, so a
// token's result does not depend on what else is in the batch (speculative verification then
// reproduces plain decoding bit for bit; tests/spec_decode).
template <int64_t MB, typename Row>
inline void dot_rows(const Row& w, const uint16_t* x, int64_t K, float* out) {
  __m512 acc[MB][kUnroll];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t u = 0; u < kUnroll; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + kLanes * kUnroll <= K; k += kLanes * kUnroll) {
    w.prefetch(k);
    for (int64_t u = 0; u < kUnroll; ++u) {
      const __m512bh wv = w.chunk(k + u * kLanes);
      for (int64_t m = 0; m < MB; ++m)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, load_bf16(x + m * K + k + u * kLanes));
    }
  }
  for (; k < K; k += kLanes) {  // tail: whole or partial 32-element chunks
    const int64_t left = K - k;
    const __m512bh wv = w.tail(k, left);
    for (int64_t m = 0; m < MB; ++m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, load_bf16(x + m * K + k, tail_mask(left)));
  }
  for (int64_t m = 0; m < MB; ++m) {
    __m512 total = acc[m][0];
    for (int64_t u = 1; u < kUnroll; ++u) total = _mm512_add_ps(total, acc[m][u]);
    out[m] = _mm512_reduce_add_ps(total);
  }
}

}  // namespace kvflow::gemv
