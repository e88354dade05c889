// SIMD pieces shared by the attention kernels (paged_decode_attention.cpp, prefill_attention.cpp):
// the 16 x 16 dword transpose that puts 16 keys along the lanes.
// kvflow's build cache hashes the headers with the sources (kvflow/kernels/build_cache.py):
// editing this file rebuilds the kernels.
#pragma once

#include "simd.h"

#include <cstdint>

namespace kvflow {

// Permutation indices of one stage of a 16 x 16 dword transpose (stage s swaps bit s of the row
// index with bit s of the column index). Rows a (bit s clear) and b (bit s set) become
//   lo[j] = j_s ? b[j - 2^s] : a[j]        hi[j] = j_s ? b[j] : a[j + 2^s]
// (indices >= 16 select from b in vpermt2d).
struct TransposeStage {
  __m512i lo, hi;
  explicit TransposeStage(int s) {
    alignas(64) int32_t l[16], h[16];
    const int32_t bit = 1 << s;
    for (int32_t j = 0; j < 16; ++j) {
      l[j] = (j & bit) ? 16 + (j & ~bit) : j;
      h[j] = (j & bit) ? 16 + j : (j | bit);
    }
    lo = _mm512_load_si512(l);
    hi = _mm512_load_si512(h);
  }
};

// The four stages of a 16 x 16 dword transpose, built once per kernel call.
struct TransposeStages {
  TransposeStage s[4] = {TransposeStage(0), TransposeStage(1), TransposeStage(2), TransposeStage(3)};
};

// r[i] = row i (16 dwords) -> r[p] = column p (dword p of every row, row i in lane i).
// Always inlined: called out of line (as GCC chose for the templated decode score pass), the 16
// rows go through memory on every call.
__attribute__((always_inline)) inline void transpose16(__m512i* r, const TransposeStages& stages) {
  for (int s = 0; s < 4; ++s) {
    const int64_t bit = int64_t(1) << s;
    for (int64_t i = 0; i < 16; ++i) {
      if (i & bit) continue;
      const __m512i a = r[i], b = r[i | bit];
      r[i] = _mm512_permutex2var_epi32(a, stages.s[s].lo, b);
      r[i | bit] = _mm512_permutex2var_epi32(a, stages.s[s].hi, b);
    }
  }
}

}  // namespace kvflow
