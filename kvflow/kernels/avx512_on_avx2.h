// The AVX-512 intrinsics kvflow's kernels use, on AVX2 + FMA + F16C (included by simd.h only when
// the build lacks -mavx512f).
//
// Why: the kernels (16 fp32 lanes per register, __mmask16 lane masks) were written for AVX512-BF16
// CPUs; Zen 2/3 and Intel client cores have AVX2 only. A 512-bit register becomes a pair of 256-bit
// ones (lo = lanes 0-7, hi = lanes 8-15), which is what a hand port to AVX2 would do, and every
// kernel keeps one source and one set of tests.
//
// Semantics are the instructions', lane for lane:
// - vdpbf16ps: acc += a_odd * b_odd, then acc += a_even * b_even per fp32 lane (a product of two
//   bf16 is exact in fp32, so two FMAs give the instruction's result);
// - vpdpbusd: the 4 u8 x s8 products of each 32-bit lane summed into it with no saturation (16-bit
//   widening and vpmaddwd, exact: unlike vpmaddubsw, which saturates);
// - vcvtneps2bf16: round to nearest even, denormal inputs to signed zero, NaN kept quiet;
// - masked loads touch no byte outside the mask (vmaskmov for 32-bit lanes, byte copies for
//   16- and 8-bit lanes, which only tails use), so a tail at the end of a page never faults.
// Only the intrinsics the kernels call are here; a new one fails to compile until it is added.
#pragma once

#include <immintrin.h>

#include <climits>
#include <cstdint>
#include <cstring>

namespace kvflow_avx2 {

#define KVFLOW_AVX2_INLINE inline __attribute__((always_inline))

struct m512 {  // 16 fp32 lanes
  __m256 lo, hi;
};
struct m512i {  // 512 bits of integers (or 32 bf16)
  __m256i lo, hi;
};

// ---- lane masks ----

// The 8 lanes [8h, 8h + 8) of a 16-lane mask as all-ones / zero 32-bit lanes.
KVFLOW_AVX2_INLINE __m256i lanes8(unsigned mask8) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(mask8 & 0xffu)), bits), bits);
}
KVFLOW_AVX2_INLINE __mmask16 movemask16(__m256 lo, __m256 hi) {
  return __mmask16(unsigned(_mm256_movemask_ps(lo)) | (unsigned(_mm256_movemask_ps(hi)) << 8));
}
KVFLOW_AVX2_INLINE __m256 blend8(__m256 a, __m256 b, unsigned mask8) {  // lane i: bit i ? b : a
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(lanes8(mask8)));
}
KVFLOW_AVX2_INLINE __m256i blend8i(__m256i a, __m256i b, unsigned mask8) {
  return _mm256_castps_si256(blend8(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), mask8));
}

// ---- set, load, store ----

KVFLOW_AVX2_INLINE m512 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
KVFLOW_AVX2_INLINE m512 set1_ps(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
KVFLOW_AVX2_INLINE m512i setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
KVFLOW_AVX2_INLINE m512i set1_epi32(int v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
KVFLOW_AVX2_INLINE m512i set1_epi8(char v) { return {_mm256_set1_epi8(v), _mm256_set1_epi8(v)}; }
KVFLOW_AVX2_INLINE m512i setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8, int e9,
                                    int e10, int e11, int e12, int e13, int e14, int e15) {
  return {_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7), _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15)};
}
KVFLOW_AVX2_INLINE m512i set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8, int e7,
                                   int e6, int e5, int e4, int e3, int e2, int e1, int e0) {
  return setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15);
}

KVFLOW_AVX2_INLINE m512 loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
KVFLOW_AVX2_INLINE void storeu_ps(float* p, m512 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
KVFLOW_AVX2_INLINE m512i loadu_si512(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
KVFLOW_AVX2_INLINE m512i load_si512(const void* p) {  // p 64-byte aligned
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_load_si256(q), _mm256_load_si256(q + 1)};
}
KVFLOW_AVX2_INLINE void storeu_si512(void* p, m512i v) {
  __m256i* q = static_cast<__m256i*>(p);
  _mm256_storeu_si256(q, v.lo);
  _mm256_storeu_si256(q + 1, v.hi);
}

KVFLOW_AVX2_INLINE m512 maskz_loadu_ps(__mmask16 k, const float* p) {
  if (k == 0xffff) return loadu_ps(p);
  return {_mm256_maskload_ps(p, lanes8(k)), _mm256_maskload_ps(p + 8, lanes8(unsigned(k) >> 8))};
}
KVFLOW_AVX2_INLINE void mask_storeu_ps(float* p, __mmask16 k, m512 v) {
  if (k == 0xffff) return storeu_ps(p, v);
  _mm256_maskstore_ps(p, lanes8(k), v.lo);
  _mm256_maskstore_ps(p + 8, lanes8(unsigned(k) >> 8), v.hi);
}
KVFLOW_AVX2_INLINE m512i maskz_loadu_epi32(__mmask16 k, const void* p) {
  const int* q = static_cast<const int*>(p);
  if (k == 0xffff) return loadu_si512(p);
  return {_mm256_maskload_epi32(q, lanes8(k)), _mm256_maskload_epi32(q + 8, lanes8(unsigned(k) >> 8))};
}

// Lanes of `bytes` bytes each, copied one by one where `k` is set (tails only: full masks load).
template <int Bytes, int Lanes>
KVFLOW_AVX2_INLINE void masked_copy_in(void* dst, const void* src, uint64_t k) {
  for (int i = 0; i < Lanes; ++i) {
    if ((k >> i) & 1u) std::memcpy(static_cast<char*>(dst) + i * Bytes, static_cast<const char*>(src) + i * Bytes, Bytes);
  }
}
KVFLOW_AVX2_INLINE __m128i mm_maskz_loadu_epi8(__mmask16 k, const void* p) {
  if (k == 0xffff) return _mm_loadu_si128(static_cast<const __m128i*>(p));
  alignas(16) uint8_t buf[16] = {};
  masked_copy_in<1, 16>(buf, p, k);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
}
KVFLOW_AVX2_INLINE __m256i mm256_maskz_loadu_epi16(__mmask16 k, const void* p) {
  if (k == 0xffff) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint16_t buf[16] = {};
  masked_copy_in<2, 16>(buf, p, k);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}
KVFLOW_AVX2_INLINE m512i maskz_loadu_epi16(__mmask32 k, const void* p) {
  if (k == 0xffffffffu) return loadu_si512(p);
  alignas(32) uint16_t buf[32] = {};
  masked_copy_in<2, 32>(buf, p, k);
  return load_si512(buf);
}
KVFLOW_AVX2_INLINE void mm256_mask_storeu_epi16(void* p, __mmask16 k, __m256i v) {
  if (k == 0xffff) return _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), v);
  for (int i = 0; i < 16; ++i) {
    if ((unsigned(k) >> i) & 1u) std::memcpy(static_cast<char*>(p) + 2 * i, buf + i, 2);
  }
}

// ---- fp32 arithmetic ----

#define KVFLOW_AVX2_PS_BINARY(name, op) \
  KVFLOW_AVX2_INLINE m512 name(m512 a, m512 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
KVFLOW_AVX2_PS_BINARY(add_ps, _mm256_add_ps)
KVFLOW_AVX2_PS_BINARY(sub_ps, _mm256_sub_ps)
KVFLOW_AVX2_PS_BINARY(mul_ps, _mm256_mul_ps)
KVFLOW_AVX2_PS_BINARY(div_ps, _mm256_div_ps)
KVFLOW_AVX2_PS_BINARY(max_ps, _mm256_max_ps)
#undef KVFLOW_AVX2_PS_BINARY

KVFLOW_AVX2_INLINE m512 fmadd_ps(m512 a, m512 b, m512 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
KVFLOW_AVX2_INLINE m512 abs_ps(m512 a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
KVFLOW_AVX2_INLINE m512 mask_mov_ps(m512 src, __mmask16 k, m512 a) {
  return {blend8(src.lo, a.lo, k), blend8(src.hi, a.hi, unsigned(k) >> 8)};
}
KVFLOW_AVX2_INLINE m512 maskz_mov_ps(__mmask16 k, m512 a) { return mask_mov_ps(setzero_ps(), k, a); }
KVFLOW_AVX2_INLINE m512 mask_max_ps(m512 src, __mmask16 k, m512 a, m512 b) { return mask_mov_ps(src, k, max_ps(a, b)); }
KVFLOW_AVX2_INLINE m512 mask_add_ps(m512 src, __mmask16 k, m512 a, m512 b) { return mask_mov_ps(src, k, add_ps(a, b)); }

// a * 2^floor(b) (vscalefps for the integral b of exp_lanes); overflows to inf as it does, the
// scale applied in two factors so that neither leaves the normal range for |b| <= 252.
KVFLOW_AVX2_INLINE __m256 scalef8(__m256 a, __m256 b) {
  __m256i n = _mm256_cvtps_epi32(_mm256_floor_ps(b));
  n = _mm256_max_epi32(_mm256_min_epi32(n, _mm256_set1_epi32(252)), _mm256_set1_epi32(-252));
  const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, f1), f2);
}
KVFLOW_AVX2_INLINE m512 scalef_ps(m512 a, m512 b) { return {scalef8(a.lo, b.lo), scalef8(a.hi, b.hi)}; }
template <int Imm>  // vrndscaleps with scale 0: vroundps takes the same rounding bits
KVFLOW_AVX2_INLINE m512 roundscale_ps(m512 a) {
  return {_mm256_round_ps(a.lo, Imm & 0x0f), _mm256_round_ps(a.hi, Imm & 0x0f)};
}

template <int Predicate>
KVFLOW_AVX2_INLINE __mmask16 cmp_ps_mask(m512 a, m512 b) {
  return movemask16(_mm256_cmp_ps(a.lo, b.lo, Predicate), _mm256_cmp_ps(a.hi, b.hi, Predicate));
}
template <int Predicate>
KVFLOW_AVX2_INLINE __mmask16 mask_cmp_ps_mask(__mmask16 k, m512 a, m512 b) {
  return __mmask16(k & cmp_ps_mask<Predicate>(a, b));
}

KVFLOW_AVX2_INLINE float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
KVFLOW_AVX2_INLINE float reduce_add_ps(m512 a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
KVFLOW_AVX2_INLINE float reduce_max_ps(m512 a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 s2 = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s2, _mm_movehdup_ps(s2)));
}

// ---- integers ----

#define KVFLOW_AVX2_SI_BINARY(name, op) \
  KVFLOW_AVX2_INLINE m512i name(m512i a, m512i b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
KVFLOW_AVX2_SI_BINARY(and_si512, _mm256_and_si256)
KVFLOW_AVX2_SI_BINARY(or_si512, _mm256_or_si256)
KVFLOW_AVX2_SI_BINARY(add_epi32, _mm256_add_epi32)
KVFLOW_AVX2_SI_BINARY(sub_epi32, _mm256_sub_epi32)
#undef KVFLOW_AVX2_SI_BINARY

KVFLOW_AVX2_INLINE m512i slli_epi32(m512i a, unsigned n) {
  return {_mm256_slli_epi32(a.lo, int(n)), _mm256_slli_epi32(a.hi, int(n))};
}
KVFLOW_AVX2_INLINE m512i srli_epi32(m512i a, unsigned n) {
  return {_mm256_srli_epi32(a.lo, int(n)), _mm256_srli_epi32(a.hi, int(n))};
}
KVFLOW_AVX2_INLINE m512i srli_epi16(m512i a, unsigned n) {
  return {_mm256_srli_epi16(a.lo, int(n)), _mm256_srli_epi16(a.hi, int(n))};
}
KVFLOW_AVX2_INLINE m512i shuffle_epi8(m512i table, m512i idx) {  // vpshufb: per 128-bit lane
  return {_mm256_shuffle_epi8(table.lo, idx.lo), _mm256_shuffle_epi8(table.hi, idx.hi)};
}
KVFLOW_AVX2_INLINE m512i broadcast_i32x4(__m128i a) {
  const __m256i both = _mm256_broadcastsi128_si256(a);
  return {both, both};
}
KVFLOW_AVX2_INLINE m512i max_epi32(m512i a, m512i b) {
  return {_mm256_max_epi32(a.lo, b.lo), _mm256_max_epi32(a.hi, b.hi)};
}
KVFLOW_AVX2_INLINE m512i slli_epi16(m512i a, unsigned n) {
  return {_mm256_slli_epi16(a.lo, int(n)), _mm256_slli_epi16(a.hi, int(n))};
}
KVFLOW_AVX2_INLINE m512i mask_mov_epi32(m512i src, __mmask16 k, m512i a) {
  return {blend8i(src.lo, a.lo, k), blend8i(src.hi, a.hi, unsigned(k) >> 8)};
}
KVFLOW_AVX2_INLINE m512i maskz_slli_epi32(__mmask16 k, m512i a, unsigned n) {
  return mask_mov_epi32(setzero_si512(), k, slli_epi32(a, n));
}
KVFLOW_AVX2_INLINE __mmask16 cmpeq_epi32_mask(m512i a, m512i b) {
  return movemask16(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a.lo, b.lo)),
                    _mm256_castsi256_ps(_mm256_cmpeq_epi32(a.hi, b.hi)));
}
KVFLOW_AVX2_INLINE __mmask16 cmpgt_epu32_mask(m512i a, m512i b) {
  const __m256i flip = _mm256_set1_epi32(INT_MIN);  // unsigned order = signed order of x ^ 2^31
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_xor_si256(a.lo, flip), _mm256_xor_si256(b.lo, flip));
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_xor_si256(a.hi, flip), _mm256_xor_si256(b.hi, flip));
  return movemask16(_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi));
}
KVFLOW_AVX2_INLINE int reduce_add_epi32(m512i a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}
KVFLOW_AVX2_INLINE int mask_reduce_min_epi32(__mmask16 k, m512i a) {
  const __m256i top = _mm256_set1_epi32(INT_MAX);  // the identity of min for unselected lanes
  const __m256i m = _mm256_min_epi32(blend8i(top, a.lo, k), blend8i(top, a.hi, unsigned(k) >> 8));
  __m128i t = _mm_min_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  t = _mm_min_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_min_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}

// ---- conversions ----

KVFLOW_AVX2_INLINE m512 castsi512_ps(m512i a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
KVFLOW_AVX2_INLINE m512i castps_si512(m512 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
KVFLOW_AVX2_INLINE m512 cvtepi32_ps(m512i a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
KVFLOW_AVX2_INLINE m512i cvtps_epi32(m512 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
KVFLOW_AVX2_INLINE m512i castsi256_si512(__m256i a) { return {a, _mm256_setzero_si256()}; }
template <int Imm>
KVFLOW_AVX2_INLINE m512i inserti64x4(m512i a, __m256i b) {
  if constexpr ((Imm & 1) == 0) return {b, a.hi};
  else return {a.lo, b};
}
template <int Imm>
KVFLOW_AVX2_INLINE __m128i extracti32x4_epi32(m512i a) {
  const __m256i half = (Imm & 2) ? a.hi : a.lo;
  if constexpr ((Imm & 1) == 0) return _mm256_castsi256_si128(half);
  else return _mm256_extracti128_si256(half, 1);
}
KVFLOW_AVX2_INLINE m512i cvtepu16_epi32(__m256i a) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
KVFLOW_AVX2_INLINE m512i cvtepu8_epi32(__m128i a) {
  return {_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))};
}
KVFLOW_AVX2_INLINE m512i cvtepi8_epi32(__m128i a) {
  return {_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))};
}
KVFLOW_AVX2_INLINE m512 cvtph_ps(__m256i a) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1))};
}
// 16 lanes whose values fit in 16 bits (each < 2^16 unsigned) -> 16 uint16 in lane order.
KVFLOW_AVX2_INLINE __m256i pack_low16(__m256i lo, __m256i hi) {
  const __m256i shuffle = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                           0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  // per 128-bit lane: the 4 low halves in its low 8 bytes; then qwords 0 and 2 of each side
  const __m256i l = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(lo, shuffle), 0x08);
  const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(hi, shuffle), 0x08);
  return _mm256_inserti128_si256(l, _mm256_castsi256_si128(h), 1);
}
KVFLOW_AVX2_INLINE __m256i cvtepi32_epi16(m512i a) { return pack_low16(a.lo, a.hi); }  // truncation
KVFLOW_AVX2_INLINE __m128i cvtsepi32_epi8(m512i a) {  // signed saturation
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xd8);
  return _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}
// 8 fp32 -> 8 bf16 bit patterns in the low halves of the 32-bit lanes (vcvtneps2bf16's rules).
KVFLOW_AVX2_INLINE __m256i to_bf16_bits8(__m256 f) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  const __m256i denormal = _mm256_cmpeq_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7f800000)),
                                              _mm256_setzero_si256());
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_blendv_epi8(r, _mm256_and_si256(bits, _mm256_set1_epi32(INT_MIN)), denormal);
  return _mm256_srli_epi32(r, 16);
}
KVFLOW_AVX2_INLINE __m256i cvtneps_pbh(m512 a) { return pack_low16(to_bf16_bits8(a.lo), to_bf16_bits8(a.hi)); }
KVFLOW_AVX2_INLINE m512i cvtne2ps_pbh(m512 a, m512 b) { return {cvtneps_pbh(b), cvtneps_pbh(a)}; }  // b low

// ---- permutes ----

// out[i] = a[idx[i] & 15] on one 8-lane half of the indices.
KVFLOW_AVX2_INLINE __m256 permute16(__m256i idx, m512 a) {
  const __m256i within = _mm256_and_si256(idx, _mm256_set1_epi32(7));
  const __m256 from_hi = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // bit 3 -> sign bit
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(a.lo, within), _mm256_permutevar8x32_ps(a.hi, within), from_hi);
}
KVFLOW_AVX2_INLINE m512 permutexvar_ps(m512i idx, m512 a) { return {permute16(idx.lo, a), permute16(idx.hi, a)}; }
// out[i] = (idx[i] & 16 ? b : a)[idx[i] & 15]
KVFLOW_AVX2_INLINE __m256 permute32(__m256i idx, m512 a, m512 b) {
  const __m256 from_b = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27));  // bit 4 -> sign bit
  return _mm256_blendv_ps(permute16(idx, a), permute16(idx, b), from_b);
}
KVFLOW_AVX2_INLINE m512 permutex2var_ps(m512 a, m512i idx, m512 b) {
  return {permute32(idx.lo, a, b), permute32(idx.hi, a, b)};
}
KVFLOW_AVX2_INLINE m512i permutex2var_epi32(m512i a, m512i idx, m512i b) {
  return castps_si512(permutex2var_ps(castsi512_ps(a), idx, castsi512_ps(b)));
}
KVFLOW_AVX2_INLINE m512i permutexvar_epi16(m512i idx, m512i a) {  // 32 words: out[i] = a[idx[i] & 31]
  alignas(32) uint16_t in[32], index[32], out[32];
  storeu_si512(in, a);
  storeu_si512(index, idx);
  for (int i = 0; i < 32; ++i) out[i] = in[index[i] & 31];
  return load_si512(out);
}

// ---- dot products ----

// vdpbf16ps: per fp32 lane, acc += a_odd * b_odd, then acc += a_even * b_even.
KVFLOW_AVX2_INLINE __m256 dpbf16_8(__m256 acc, __m256i a, __m256i b) {
  const __m256i top = _mm256_set1_epi32(int(0xffff0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, top)), _mm256_castsi256_ps(_mm256_and_si256(b, top)),
                        acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)),
                         acc);
}
KVFLOW_AVX2_INLINE m512 dpbf16_ps(m512 acc, m512i a, m512i b) {
  return {dpbf16_8(acc.lo, a.lo, b.lo), dpbf16_8(acc.hi, a.hi, b.hi)};
}
// vpdpbusd: per 32-bit lane, acc += the 4 products of a's unsigned bytes with b's signed bytes.
KVFLOW_AVX2_INLINE __m256i dpbusd_8(__m256i acc, __m256i a, __m256i b) {
  const __m256i a_even = _mm256_and_si256(a, _mm256_set1_epi16(0x00ff)), a_odd = _mm256_srli_epi16(a, 8);
  const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), b_odd = _mm256_srai_epi16(b, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even), _mm256_madd_epi16(a_odd, b_odd)));
}
KVFLOW_AVX2_INLINE m512i dpbusd_epi32(m512i acc, m512i a, m512i b) {
  return {dpbusd_8(acc.lo, a.lo, b.lo), dpbusd_8(acc.hi, a.hi, b.hi)};
}

// Cheaper forms of vpdpbusd for the weight-only GEMVs, where the operands' ranges let vpmaddubsw
// (u8 x s8 pairs summed into int16, saturating) be exact: 2 multiplies per 32 bytes instead of
// vpdpbusd's 16-bit widening above (the int8 / int4 GEMVs were compute-bound on it: ~12 GB/s).
//
// The int4 GEMV's block dot in two steps: int16 partial sums of up to kNibbleProductsInInt16
// vpmaddubsw results (nibble 0..15 x int8: |pair| <= 2 * 15 * 128 = 3840, so 8 of them sum to at
// most 30720 < 2^15: exact), then one vpmaddwd against ones into the vpdpbusd lanes. Per 32 inputs
// and half: 8 multiplies, 7 16-bit adds and 1 vpmaddwd, where a vpmaddwd and a 32-bit add per
// vpmaddubsw (vpdpbusd's form) took 8 of each: a prefill GEMM is bound by the multiply ports.
constexpr int kNibbleProductsInInt16 = 8;
KVFLOW_AVX2_INLINE m512i maddubs_add_epi16(m512i acc16, m512i a, m512i b) {
  return {_mm256_add_epi16(acc16.lo, _mm256_maddubs_epi16(a.lo, b.lo)),
          _mm256_add_epi16(acc16.hi, _mm256_maddubs_epi16(a.hi, b.hi))};
}
KVFLOW_AVX2_INLINE m512i widen_pair_sums(m512i acc16) {  // adjacent int16 pairs summed into int32 lanes
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(acc16.lo, ones), _mm256_madd_epi16(acc16.hi, ones)};
}
// Weights stored as the unsigned byte q + 128 with |q| <= 127, split once per load for dpbssd.
struct SignedWeights {
  m512i q, magnitude;  // q (signed bytes) and |q|
};
KVFLOW_AVX2_INLINE SignedWeights signed_weights(m512i stored) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));  // byte - 128 = byte ^ 0x80 as a signed byte
  const __m256i lo = _mm256_xor_si256(stored.lo, flip), hi = _mm256_xor_si256(stored.hi, flip);
  return {{lo, hi}, {_mm256_abs_epi8(lo), _mm256_abs_epi8(hi)}};
}
// acc + the 4 products q x b of each 32-bit lane (b signed bytes, |b| <= 127): |q| times b with q's
// sign moved onto b (vpsignb), so each vpmaddubsw pair is at most 2 * 127 * 127 < 2^15.
KVFLOW_AVX2_INLINE m512i dpbssd(m512i acc, const SignedWeights& w, m512i b) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i lo = _mm256_maddubs_epi16(w.magnitude.lo, _mm256_sign_epi8(b.lo, w.q.lo));
  const __m256i hi = _mm256_maddubs_epi16(w.magnitude.hi, _mm256_sign_epi8(b.hi, w.q.hi));
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(lo, ones)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(hi, ones))};
}

}  // namespace kvflow_avx2

// The AVX-512 names, as the kernels spell them.
#define __m512 kvflow_avx2::m512
#define __m512i kvflow_avx2::m512i
#define __m512bh kvflow_avx2::m512i
#define __m256bh __m256i
// GCC's immintrin.h defines these as macros (the immediate-operand ones only without -O), so
// they are undefined before the stand-ins take their names.
#undef _mm512_setr_epi32
#undef _mm512_cmp_ps_mask
#undef _mm512_mask_cmp_ps_mask
#undef _mm512_roundscale_ps
#undef _mm512_extracti32x4_epi32
#undef _mm512_inserti64x4
#undef _mm512_slli_epi16
#undef _mm512_slli_epi32
#undef _mm512_srli_epi16
#undef _mm512_srli_epi32
#undef _mm512_maskz_slli_epi32

#define _mm512_setzero_ps kvflow_avx2::setzero_ps
#define _mm512_set1_ps kvflow_avx2::set1_ps
#define _mm512_setzero_si512 kvflow_avx2::setzero_si512
#define _mm512_set1_epi32 kvflow_avx2::set1_epi32
#define _mm512_set1_epi8 kvflow_avx2::set1_epi8
#define _mm512_set_epi32 kvflow_avx2::set_epi32
#define _mm512_setr_epi32 kvflow_avx2::setr_epi32
#define _mm512_loadu_ps kvflow_avx2::loadu_ps
#define _mm512_storeu_ps kvflow_avx2::storeu_ps
#define _mm512_loadu_si512 kvflow_avx2::loadu_si512
#define _mm512_load_si512 kvflow_avx2::load_si512
#define _mm512_storeu_si512 kvflow_avx2::storeu_si512
#define _mm512_maskz_loadu_ps kvflow_avx2::maskz_loadu_ps
#define _mm512_mask_storeu_ps kvflow_avx2::mask_storeu_ps
#define _mm512_maskz_loadu_epi32 kvflow_avx2::maskz_loadu_epi32
#define _mm512_maskz_loadu_epi16 kvflow_avx2::maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 kvflow_avx2::mm256_maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 kvflow_avx2::mm256_mask_storeu_epi16
#define _mm_maskz_loadu_epi8 kvflow_avx2::mm_maskz_loadu_epi8
#define _mm512_add_ps kvflow_avx2::add_ps
#define _mm512_sub_ps kvflow_avx2::sub_ps
#define _mm512_mul_ps kvflow_avx2::mul_ps
#define _mm512_div_ps kvflow_avx2::div_ps
#define _mm512_max_ps kvflow_avx2::max_ps
#define _mm512_fmadd_ps kvflow_avx2::fmadd_ps
#define _mm512_abs_ps kvflow_avx2::abs_ps
#define _mm512_mask_mov_ps kvflow_avx2::mask_mov_ps
#define _mm512_maskz_mov_ps kvflow_avx2::maskz_mov_ps
#define _mm512_mask_max_ps kvflow_avx2::mask_max_ps
#define _mm512_mask_add_ps kvflow_avx2::mask_add_ps
#define _mm512_scalef_ps kvflow_avx2::scalef_ps
#define _mm512_roundscale_ps(a, imm) kvflow_avx2::roundscale_ps<(imm)>(a)
#define _mm512_cmp_ps_mask(a, b, p) kvflow_avx2::cmp_ps_mask<(p)>((a), (b))
#define _mm512_mask_cmp_ps_mask(k, a, b, p) kvflow_avx2::mask_cmp_ps_mask<(p)>((k), (a), (b))
#define _mm512_reduce_add_ps kvflow_avx2::reduce_add_ps
#define _mm512_reduce_max_ps kvflow_avx2::reduce_max_ps
#define _mm512_and_si512 kvflow_avx2::and_si512
#define _mm512_or_si512 kvflow_avx2::or_si512
#define _mm512_add_epi32 kvflow_avx2::add_epi32
#define _mm512_sub_epi32 kvflow_avx2::sub_epi32
#define _mm512_slli_epi32 kvflow_avx2::slli_epi32
#define _mm512_srli_epi32 kvflow_avx2::srli_epi32
#define _mm512_srli_epi16 kvflow_avx2::srli_epi16
#define _mm512_slli_epi16 kvflow_avx2::slli_epi16
#define _mm512_shuffle_epi8 kvflow_avx2::shuffle_epi8
#define _mm512_broadcast_i32x4 kvflow_avx2::broadcast_i32x4
#define _mm512_max_epi32 kvflow_avx2::max_epi32
#define _mm512_mask_mov_epi32 kvflow_avx2::mask_mov_epi32
#define _mm512_cmpgt_epu32_mask kvflow_avx2::cmpgt_epu32_mask
#define _mm512_cmpeq_epi32_mask kvflow_avx2::cmpeq_epi32_mask
#define _mm512_maskz_slli_epi32 kvflow_avx2::maskz_slli_epi32
#define _mm512_reduce_add_epi32 kvflow_avx2::reduce_add_epi32
#define _mm512_mask_reduce_min_epi32 kvflow_avx2::mask_reduce_min_epi32
#define _mm512_castsi512_ps kvflow_avx2::castsi512_ps
#define _mm512_castps_si512 kvflow_avx2::castps_si512
#define _mm512_cvtepi32_ps kvflow_avx2::cvtepi32_ps
#define _mm512_cvtps_epi32 kvflow_avx2::cvtps_epi32
#define _mm512_castsi256_si512 kvflow_avx2::castsi256_si512
#define _mm512_inserti64x4(a, b, imm) kvflow_avx2::inserti64x4<(imm)>((a), (b))
#define _mm512_extracti32x4_epi32(a, imm) kvflow_avx2::extracti32x4_epi32<(imm)>(a)
#define _mm512_cvtepu16_epi32 kvflow_avx2::cvtepu16_epi32
#define _mm512_cvtepu8_epi32 kvflow_avx2::cvtepu8_epi32
#define _mm512_cvtepi8_epi32 kvflow_avx2::cvtepi8_epi32
#define _mm512_cvtph_ps kvflow_avx2::cvtph_ps
#define _mm512_cvtepi32_epi16 kvflow_avx2::cvtepi32_epi16
#define _mm512_cvtsepi32_epi8 kvflow_avx2::cvtsepi32_epi8
#define _mm512_cvtneps_pbh kvflow_avx2::cvtneps_pbh
#define _mm512_cvtne2ps_pbh kvflow_avx2::cvtne2ps_pbh
#define _mm512_permutexvar_ps kvflow_avx2::permutexvar_ps
#define _mm512_permutex2var_ps kvflow_avx2::permutex2var_ps
#define _mm512_permutex2var_epi32 kvflow_avx2::permutex2var_epi32
#define _mm512_permutexvar_epi16 kvflow_avx2::permutexvar_epi16
#define _mm512_dpbf16_ps kvflow_avx2::dpbf16_ps
#define _mm512_dpbusd_epi32 kvflow_avx2::dpbusd_epi32
