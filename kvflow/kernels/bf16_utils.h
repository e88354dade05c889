// Shared helpers of kvflow's bf16 CPU kernels.
// kvflow's build cache hashes the headers with the sources (kvflow/kernels/build_cache.py):
// editing this file rebuilds the kernels.
#pragma once

#include "simd.h"

#include <cstdint>
#include <cstring>

namespace kvflow {

// float32 -> bfloat16 with round-to-nearest-even, as torch casts (NaN stays a quiet NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// bfloat16 -> float32: bf16 is the top half of an fp32 (exact).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 16 lanes of float_to_bf16 (the same bits: integer round-to-nearest-even, NaN kept quiet; unlike
// vcvtneps2bf16, which flushes denormals), each result in the top half of its 32-bit lane (so the
// lane reads as the rounded fp32 value).
inline __m512i round_to_bf16_lanes(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
  return _mm512_and_si512(_mm512_mask_mov_epi32(rounded, nan, quiet), _mm512_set1_epi32(int32_t(0xffff0000u)));
}

// fp32 -> fp32 rounded through bf16 (through_bf16 on 16 lanes).
inline __m512 through_bf16_lanes(__m512 f) { return _mm512_castsi512_ps(round_to_bf16_lanes(f)); }

// Store 16 lanes as bf16 (float_to_bf16 each), `mask` selecting the lanes written.
inline void store_bf16_lanes(uint16_t* p, __m512 f, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_to_bf16_lanes(f), 16)));
}

// 16 bf16 -> fp32 (`mask` selecting the lanes read, the others 0).
inline __m512 load_bf16_lanes(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// exp(x) on 16 lanes: 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5], 2^f by its degree-6 Taylor
// polynomial (relative error < 2e-7). Past ~88.7 vscalefps overflows to +inf, as expf does; below
// -87 the argument is clamped (exp(-87) ~ 1.6e-38: a softmax weight or sigmoid term that small is 0
// to every consumer here).
inline __m512 exp_lanes(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);                 // ln2^6 / 720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 lanes_left(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

}  // namespace kvflow
