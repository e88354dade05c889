// Weight-only GEMVs on llama.cpp's (ggml's) 4/5/6-bit block types, read as a GGUF file stores
// their bits: Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4 (gpt-oss's experts, from a GGUF
// file or the Hugging Face checkpoint) and NVFP4 (GGUF's, and compressed-tensors' nvfp4-pack-quantized;
// Q8_0 runs on gemv_int8.cpp's tiles). The
// values and scales are the file's, only re-laid per 16 rows at load (kvflow/quant/gguf_linear.py);
// nothing is requantized.
//
// Every type is, per group of g inputs (g = 32; Q6_K: 16) of row n, levels q in 0 .. 2^bits - 1
// with an affine map W = s * q + z:
//   Q4_0  s = d (fp16 per 32)           z = -8 s          Q5_0  s = d   z = -16 s
//   Q4_1  s = d                         z = m (fp16)      Q5_1  s = d   z = m
//   Q4_K / Q5_K  s = d * sc, z = -dmin * m: d, dmin fp16 per 256 inputs, sc, m 6-bit per 32
//   Q6_K  s = d * sc (d fp16 per 256, sc int8 per 16), z = -32 s
//   MXFP4 the 4-bit codes are e2m1 numbers, not levels: a byte shuffle maps code c to
//         u = 2 e2m1(c) + 12 in 0..24 (ggml's doubled kvalues, offset to be unsigned), then
//         s = 2^(e - 128) (the e8m0 scale per 32, halved for the doubling), z = -12 s
//         (e = 0, a scale of 2^-128, reads as 0: no checkpoint has one)
//   NVFP4 the same e2m1 codes through the same table, groups of 16, each with an unsigned e4m3 scale
//         d (bias 7, subnormals; 0x7F, e4m3's NaN, reads as 0 as ggml reads it) and a per-row
//         divisor G (compressed-tensors' weight_global_scale; 1 in a GGUF file):
//         s = (d / G) / 2 (halved for the doubling), z = -12 s: compressed-tensors' scale / global_scale.
//         The tiles hold the row factor f = 128 / G (2^8 / 2 / G, rounded once at load; a division
//         per group instead measured the same at 1 row, 3% slower at 8) and s = (d 2^-8) f
// s and z are computed in fp32 from the stored fields as ggml does (d * sc is exact in fp32).
//
// Layout: tiles of 16 output rows (N padded with zero rows), per tile and block of 32 inputs
// (kBlock), 256 bytes of low nibbles in int4's layout (gemv_int4.cpp: quarter c, byte 4l + i =
// q[l][8c + i] & 15 | (q[l][8c + 4 + i] & 15) << 4), then one 64-byte plane per high bit (Q5: 1,
// Q6_K: 2): bit j of byte 4l + i holds bit 4 + p of q[l][4j + i], so that for quarter c and half h
// (j = 2c + h) one shift and one AND put it in place beside the nibble. values: [T, K / 32, 256 +
// 64 planes] uint8. Scales and minima per tile and group, 16 lanes each (one per row):
//   scales  fp16 [T, K / 32, 16] (d: Q4_0/1, Q5_0/1) | uint8 (sc: Q4_K, Q5_K; e: MXFP4) | int8
//   [T, K / 16, 16] (sc: Q6_K) | uint8 [T, K / 16, 16] (d: NVFP4); mins  fp16 [T, K / 32, 16] (m: Q4_1,
//   Q5_1) | uint8 (m: Q4_K, Q5_K) | fp32 [T, 16] (f = 128 / G: NVFP4); supers  fp16
//   [T, K / 256, 2, 16] (d, dmin: Q4_K, Q5_K) | [T, K / 256, 1, 16] (d: Q6_K).
//
// skinny_linear_ggml: y[M, N] = x[M, K] @ W^T (+ bias), few rows (decode). The activations are
// quantized to int8 per 32 inputs (activation_quant.h, as llama.cpp's q8 does for these types);
// vpdpbusd multiplies 4 unsigned levels of each of 16 rows by 4 activations and sums them into 16
// int32 lanes (no horizontal sums), then per group:
//   y[m, n] += s_n,g * dx_m,b * (q_n,g . xq_m,g)  +  z_n,g * xsum_m,g      (xsum: exact fp32 sum of x)
// in block order whatever M is (batch-invariant).
//
// dequantize_ggml_rows: W[n0:n1] as bf16 [rows, K] (s * q + z in fp32, rounded once), n0 a
// multiple of 16, for prefill chunks multiplied a block at a time by oneDNN.

#include <ATen/Parallel.h>
#include "aten_lite.h"
#include "simd.h"

#include "activation_quant.h"
#include "argmax_lanes.h"
#include "bf16_utils.h"
#include "row_dispatch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#pragma GCC target("avx512vnni")
#endif

namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kBlock = 32;          // inputs per activation scale and per nibble block
constexpr int64_t kNibbleBytes = 256;   // 16 rows x 32 levels' low nibbles
constexpr int64_t kPlaneBytes = 64;     // 16 rows x 32 levels' bit 4 (or 5)
constexpr int64_t kSuperBlock = 256;    // K-quants' super-block (QK_K)
constexpr int64_t kPrefetchBytes = 1024;
#if defined(__AVX512F__)
constexpr int64_t kMaxRowsPerPass = 8;
#else
constexpr int64_t kMaxRowsPerPass = 4;
#endif

// ggml type ids (gguf.GGMLQuantizationType) of the formats below.
enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kMXFP4 = 39, kNVFP4 = 40
};

// How a format's (s, z) per group are stored (header comment).
enum class Params { kScaleOffset, kScaleMin, kSuperScaleMin, kSuperScaleOffset, kE8M0Offset, kUE4M3Offset };
constexpr float kMxfp4Offset = 12;  // u = 2 e2m1 + 12: the doubled e2m1 values are -12 .. 12

template <int64_t kType>
struct Format;
template <>
struct Format<kQ4_0> { static constexpr int kPlanes = 0, kGroups = 1; static constexpr Params kParams = Params::kScaleOffset; static constexpr float kOffset = 8; };
template <>
struct Format<kQ4_1> { static constexpr int kPlanes = 0, kGroups = 1; static constexpr Params kParams = Params::kScaleMin; static constexpr float kOffset = 0; };
template <>
struct Format<kQ5_0> { static constexpr int kPlanes = 1, kGroups = 1; static constexpr Params kParams = Params::kScaleOffset; static constexpr float kOffset = 16; };
template <>
struct Format<kQ5_1> { static constexpr int kPlanes = 1, kGroups = 1; static constexpr Params kParams = Params::kScaleMin; static constexpr float kOffset = 0; };
template <>
struct Format<kQ4_K> { static constexpr int kPlanes = 0, kGroups = 1; static constexpr Params kParams = Params::kSuperScaleMin; static constexpr float kOffset = 0; };
template <>
struct Format<kQ5_K> { static constexpr int kPlanes = 1, kGroups = 1; static constexpr Params kParams = Params::kSuperScaleMin; static constexpr float kOffset = 0; };
template <>
struct Format<kQ6_K> { static constexpr int kPlanes = 2, kGroups = 2; static constexpr Params kParams = Params::kSuperScaleOffset; static constexpr float kOffset = 32; };
template <>
struct Format<kMXFP4> { static constexpr int kPlanes = 0, kGroups = 1; static constexpr Params kParams = Params::kE8M0Offset; static constexpr float kOffset = kMxfp4Offset; };
template <>
struct Format<kNVFP4> { static constexpr int kPlanes = 0, kGroups = 2; static constexpr Params kParams = Params::kUE4M3Offset; static constexpr float kOffset = kMxfp4Offset; };

// Whether a format's 4-bit codes go through kCodeTable (MXFP4's and NVFP4's e2m1) before the dot products.
template <int64_t kType>
constexpr bool kHasCodeTable = Format<kType>::kParams == Params::kE8M0Offset || Format<kType>::kParams == Params::kUE4M3Offset;
// e2m1 code -> 2 e2m1 + 12 (codes 0-7: 0, .5, 1, 1.5, 2, 3, 4, 6; 8-15 the same negated), as bytes,
// the same 16 in each 128-bit lane for vpshufb.
inline __m512i code_table() {
  const __m128i t = _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  return _mm512_broadcast_i32x4(t);
}

inline __m512 load_fp16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 unsigned e4m3 bytes (bias 7) as fp32 times 2^-8, exactly: the 7 bits moved into fp16's
// exponent and mantissa fields read as the value times 2^-8 (fp16's bias is 15; subnormals map onto
// fp16 subnormals), widened by vcvtph2ps; 0x7F (NaN) -> 0. The 2^8 is folded into the row factor.
inline __m512 load_ue4m3x16_over_256(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7F));
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_maskz_slli_epi32(~nan, magnitude, 7)));
}
inline __m512 load_i8x16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Bit j of each byte of `plane`, moved to bit `kBit` (the rest 0). 16-bit shifts: what crosses into
// the neighbouring byte lands below kBit there and is masked off.
template <int kJ, int kBit>
inline __m512i plane_bit(__m512i plane) {
  const __m512i mask = _mm512_set1_epi8(char(1 << kBit));
  if constexpr (kJ == kBit) return _mm512_and_si512(plane, mask);
  else if constexpr (kJ < kBit) return _mm512_and_si512(_mm512_slli_epi16(plane, kBit - kJ), mask);
  else return _mm512_and_si512(_mm512_srli_epi16(plane, kJ - kBit), mask);
}

// The levels of quarter kC (both halves) of one tile-block: 16 rows x 4 levels per register.
template <int kPlanes, int kC, bool kTable = false>
inline void quarter_levels(const uint8_t* wb, const __m512i* planes, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i packed = _mm512_loadu_si512(wb + 64 * kC);
  lo = _mm512_and_si512(packed, nibble);
  hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  if constexpr (kTable) {
    const __m512i table = code_table();
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
  }
  if constexpr (kPlanes >= 1) {
    lo = _mm512_or_si512(lo, plane_bit<2 * kC, 4>(planes[0]));
    hi = _mm512_or_si512(hi, plane_bit<2 * kC + 1, 4>(planes[0]));
  }
  if constexpr (kPlanes >= 2) {
    lo = _mm512_or_si512(lo, plane_bit<2 * kC, 5>(planes[1]));
    hi = _mm512_or_si512(hi, plane_bit<2 * kC + 1, 5>(planes[1]));
  }
}

struct Tensors {
  const uint8_t* values;   // [T, K / 32, block_bytes]
  const void* scales;      // per Format (header comment)
  const void* mins;
  const uint16_t* supers;  // fp16
  int64_t K, N, tiles;
};

// (s, z) of group g (0 .. kGroups - 1) of block b in tile t, 16 lanes.
template <int64_t kType>
inline void group_params(const Tensors& w, int64_t t, int64_t b, int g, __m512& s, __m512& z) {
  using F = Format<kType>;
  const int64_t blocks = w.K / kBlock;
  if constexpr (F::kParams == Params::kScaleOffset || F::kParams == Params::kScaleMin) {
    s = load_fp16x16(static_cast<const uint16_t*>(w.scales) + (t * blocks + b) * kTileRows);
    if constexpr (F::kParams == Params::kScaleOffset) z = _mm512_mul_ps(s, _mm512_set1_ps(-F::kOffset));
    else z = load_fp16x16(static_cast<const uint16_t*>(w.mins) + (t * blocks + b) * kTileRows);
  } else if constexpr (F::kParams == Params::kSuperScaleMin) {
    const int64_t supers = w.K / kSuperBlock, sb = b * kBlock / kSuperBlock;
    const uint16_t* dd = w.supers + ((t * supers + sb) * 2) * kTileRows;
    s = _mm512_mul_ps(load_fp16x16(dd), load_u8x16(static_cast<const uint8_t*>(w.scales) + (t * blocks + b) * kTileRows));
    const __m512 dm = _mm512_mul_ps(load_fp16x16(dd + kTileRows),
                                    load_u8x16(static_cast<const uint8_t*>(w.mins) + (t * blocks + b) * kTileRows));
    z = _mm512_sub_ps(_mm512_setzero_ps(), dm);
  } else if constexpr (F::kParams == Params::kE8M0Offset) {  // MXFP4: s = 2^(e - 128)
    const __m512i e = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.scales) + (t * blocks + b) * kTileRows)));
    // (e - 1) << 23 is 2^(e - 128) as fp32 for e >= 1 (e = 1: 0.0, not 2^-127; header comment).
    const __m512i biased = _mm512_max_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), _mm512_setzero_si512());
    s = _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23));
    z = _mm512_mul_ps(s, _mm512_set1_ps(-F::kOffset));
  } else if constexpr (F::kParams == Params::kUE4M3Offset) {  // NVFP4: s = d 2^-8 * (128 / G), groups of 16
    const __m512 d = load_ue4m3x16_over_256(static_cast<const uint8_t*>(w.scales) + (t * 2 * blocks + 2 * b + g) * kTileRows);
    s = _mm512_mul_ps(d, _mm512_loadu_ps(static_cast<const float*>(w.mins) + t * kTileRows));
    z = _mm512_mul_ps(s, _mm512_set1_ps(-F::kOffset));
  } else {  // kSuperScaleOffset: Q6_K, groups of 16
    const int64_t supers = w.K / kSuperBlock, sb = b * kBlock / kSuperBlock;
    const __m512 d = load_fp16x16(w.supers + (t * supers + sb) * kTileRows);
    s = _mm512_mul_ps(d, load_i8x16(static_cast<const int8_t*>(w.scales) + (t * 2 * blocks + 2 * b + g) * kTileRows));
    z = _mm512_mul_ps(s, _mm512_set1_ps(-F::kOffset));
  }
}

// The activations as the GEMV reads them: int8 per 32 inputs and exact sums per 16.
struct Activations {
  kvflow::Int8Activations q8;
  std::vector<float> sums16;  // [M, K / 16]
};

Activations quantize_activations(const uint16_t* x, int64_t M, int64_t K) {
  Activations a{kvflow::quantize_activations_int8(x, M, K), std::vector<float>(M * (K / 16))};
  at::parallel_for(0, M, kvflow::kQuantizeGrainRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t j = 0; j < K / 16; ++j)
        a.sums16[m * (K / 16) + j] = _mm512_reduce_add_ps(kvflow::load_bf16_lanes(x + m * K + 16 * j, 0xffff));
  });
  return a;
}

constexpr int64_t kGgmlTileStreams(int64_t rows) { return kvflow::kTileStreams(rows) > 1 && rows <= 2 ? 2 : 1; }

template <int64_t kType>
struct Gemv {
  using F = Format<kType>;
  static constexpr int64_t kBlockBytes = kNibbleBytes + F::kPlanes * kPlaneBytes;
  Tensors w;
  const Activations* x;
  const float* bias;
  uint16_t* y;
  int64_t M;

  template <int64_t MB, int64_t S>
  inline void tile_dot(int64_t t, int64_t m0, __m512 (*acc)[kMaxRowsPerPass]) const {
    const int64_t blocks = w.K / kBlock;
    const uint8_t* wt[S];
    for (int64_t i = 0; i < S; ++i) {
      wt[i] = w.values + (t + i) * blocks * kBlockBytes;
      for (int64_t m = 0; m < MB; ++m) acc[i][m] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t i = 0; i < S; ++i) {
        const uint8_t* wb = wt[i] + b * kBlockBytes;
        for (int64_t line = 0; line < kBlockBytes; line += kvflow::kWeightPrefetchStride)
          _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);
        __m512i planes[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int p = 0; p < F::kPlanes; ++p) planes[p] = _mm512_loadu_si512(wb + kNibbleBytes + p * kPlaneBytes);
        __m512i dot[F::kGroups][MB];
        for (int g = 0; g < F::kGroups; ++g)
          for (int64_t m = 0; m < MB; ++m) dot[g][m] = _mm512_setzero_si512();
        quarter<MB, 0>(wb, planes, m0, b, dot);
        quarter<MB, 1>(wb, planes, m0, b, dot);
        quarter<MB, 2>(wb, planes, m0, b, dot);
        quarter<MB, 3>(wb, planes, m0, b, dot);
        for (int g = 0; g < F::kGroups; ++g) {
          __m512 s, z;
          group_params<kType>(w, t + i, b, g, s, z);
          const int64_t g16 = F::kGroups == 2 ? 2 * b + g : 2 * b;  // first 16-input sum of the group
          for (int64_t m = 0; m < MB; ++m) {
            const int64_t row = m0 + m;
            const float dx = x->q8.scales[row * blocks + b];
            const float* sums = x->sums16.data() + row * (w.K / 16);
            const float xsum = F::kGroups == 2 ? sums[g16] : sums[g16] + sums[g16 + 1];
            acc[i][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g][m]), _mm512_mul_ps(s, _mm512_set1_ps(dx)), acc[i][m]);
            acc[i][m] = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum), acc[i][m]);
          }
        }
      }
    }
  }

  // Quarter kC of a block: levels of inputs 8 kC .. 8 kC + 7 times the matching activations,
  // into the dot of its group (Q6_K: quarters 0-1 group 0, 2-3 group 1).
  template <int64_t MB, int kC>
  inline void quarter(const uint8_t* wb, const __m512i* planes, int64_t m0, int64_t b,
                      __m512i (*dot)[MB]) const {
    __m512i lo, hi;
    quarter_levels<F::kPlanes, kC, kHasCodeTable<kType>>(wb, planes, lo, hi);
    constexpr int g = F::kGroups == 2 ? kC / 2 : 0;
    for (int64_t m = 0; m < MB; ++m) {
      const int8_t* xq = x->q8.q.data() + (m0 + m) * x->q8.padded_k + b * kBlock + 8 * kC;
      int32_t x_lo, x_hi;
      std::memcpy(&x_lo, xq, 4);
      std::memcpy(&x_hi, xq + 4, 4);
      dot[g][m] = _mm512_dpbusd_epi32(dot[g][m], lo, _mm512_set1_epi32(x_lo));
      dot[g][m] = _mm512_dpbusd_epi32(dot[g][m], hi, _mm512_set1_epi32(x_hi));
    }
  }

  template <int64_t MB, int64_t S>
  inline void tile_rows(int64_t t, int64_t m0) const {
    __m512 acc[S][kMaxRowsPerPass];
    tile_dot<MB, S>(t, m0, acc);
    for (int64_t i = 0; i < S; ++i) {
      const int64_t n0 = (t + i) * kTileRows;
      const __mmask16 keep = kvflow::lanes_left(w.N - n0);
      const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
      for (int64_t m = 0; m < MB; ++m) {
        const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][m], bv));
        _mm256_mask_storeu_epi16(y + (m0 + m) * w.N + n0, keep, out);
      }
    }
  }

  void tiles(int64_t t_begin, int64_t t_end) const {
    kvflow::for_tile_groups<kGgmlTileStreams, kMaxRowsPerPass>(
        t_begin, t_end, M, [&](auto rows, auto streams, int64_t t, int64_t m0) {
          tile_rows<decltype(rows)::value, decltype(streams)::value>(t, m0);
        });
  }

  // Rows [n_begin, n_end) of W as bf16 (row-major [rows, K]).
  void dequantize(int64_t n_begin, int64_t n_end, uint16_t* out) const {
    const int64_t blocks = w.K / kBlock;
    const int64_t t_begin = n_begin / kTileRows, t_end = (n_end + kTileRows - 1) / kTileRows;
    at::parallel_for(t_begin, t_end, 1, [&](int64_t begin, int64_t end) {
      alignas(64) uint8_t levels[8][64];  // (quarter, half) -> the 16 rows' 4 levels each
      alignas(64) float sv[2][kTileRows], zv[2][kTileRows];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t rows = std::min(kTileRows, n_end - t * kTileRows);
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* wb = w.values + (t * blocks + b) * kBlockBytes;
          __m512i planes[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
          for (int p = 0; p < F::kPlanes; ++p) planes[p] = _mm512_loadu_si512(wb + kNibbleBytes + p * kPlaneBytes);
          __m512i lo, hi;
          constexpr bool kTable = kHasCodeTable<kType>;
          quarter_levels<F::kPlanes, 0, kTable>(wb, planes, lo, hi); store(levels[0], lo); store(levels[1], hi);
          quarter_levels<F::kPlanes, 1, kTable>(wb, planes, lo, hi); store(levels[2], lo); store(levels[3], hi);
          quarter_levels<F::kPlanes, 2, kTable>(wb, planes, lo, hi); store(levels[4], lo); store(levels[5], hi);
          quarter_levels<F::kPlanes, 3, kTable>(wb, planes, lo, hi); store(levels[6], lo); store(levels[7], hi);
          for (int g = 0; g < F::kGroups; ++g) {
            __m512 s, z;
            group_params<kType>(w, t, b, g, s, z);
            _mm512_storeu_ps(sv[g], s);
            _mm512_storeu_ps(zv[g], z);
          }
          for (int64_t l = 0; l < rows; ++l) {
            const int64_t n = t * kTileRows + l;
            if (n < n_begin) continue;
            alignas(32) uint8_t q[kBlock];  // the row's 32 levels in input order: 4j + i
            for (int j = 0; j < 8; ++j) std::memcpy(q + 4 * j, levels[j] + 4 * l, 4);
            uint16_t* dst = out + (n - n_begin) * w.K + b * kBlock;
            for (int h = 0; h < 2; ++h) {  // inputs 16h .. 16h + 15 (Q6_K: group h)
              const int g = F::kGroups == 2 ? h : 0;
              const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h))));
              const __m512 wv = _mm512_fmadd_ps(v, _mm512_set1_ps(sv[g][l]), _mm512_set1_ps(zv[g][l]));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * h), (__m256i)_mm512_cvtneps_pbh(wv));
            }
          }
        }
      }
    });
  }

  static void store(uint8_t* p, __m512i v) { _mm512_storeu_si512(p, v); }
};

Tensors check_tensors(int64_t type, const at::Tensor& values, const at::Tensor& scales, const at::Tensor& mins,
                      const at::Tensor& supers, int64_t N) {
  TORCH_CHECK(values.dtype() == at::kByte && values.dim() == 3 && values.is_contiguous(),
              "values must be [N_pad / 16, K / 32, block bytes] uint8 (kvflow/quant/gguf_linear.py)");
  TORCH_CHECK(scales.is_contiguous() && mins.is_contiguous() && supers.is_contiguous(), "contiguous params expected");
  const int64_t tiles = values.size(0), K = values.size(1) * kBlock;
  TORCH_CHECK(0 < N && N <= tiles * kTileRows && N > (tiles - 1) * kTileRows, "N does not match the tiles");
  int64_t planes = 0, scale_groups = K / kBlock, min_groups = 0, super_fields = 0;
  switch (type) {
    case kQ4_0: break;
    case kQ4_1: min_groups = K / kBlock; break;
    case kQ5_0: planes = 1; break;
    case kQ5_1: planes = 1; min_groups = K / kBlock; break;
    case kQ4_K: min_groups = K / kBlock; super_fields = 2; break;
    case kQ5_K: planes = 1; min_groups = K / kBlock; super_fields = 2; break;
    case kQ6_K: planes = 2; scale_groups = K / 16; super_fields = 1; break;
    case kMXFP4: break;
    case kNVFP4: scale_groups = K / 16; break;
    default: TORCH_CHECK(false, "ggml type ", type, " has no GEMV here (kvflow/kernels/gemv_ggml.cpp)");
  }
  TORCH_CHECK(values.size(2) == kNibbleBytes + planes * kPlaneBytes, "block bytes do not match ggml type ", type);
  TORCH_CHECK(scales.numel() == tiles * scale_groups * kTileRows, "scales do not match the tiles");
  TORCH_CHECK(type == kNVFP4 ? mins.numel() == tiles * kTileRows && mins.dtype() == at::kFloat
                             : mins.numel() == tiles * min_groups * kTileRows,
              "mins do not match the tiles");
  TORCH_CHECK(supers.numel() == tiles * (super_fields ? K / kSuperBlock : 0) * super_fields * kTileRows &&
                  (super_fields == 0 || (K % kSuperBlock == 0 && supers.dtype() == at::kHalf)),
              "supers do not match the tiles");
  const bool fp16_scales = type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1;
  TORCH_CHECK(fp16_scales ? scales.dtype() == at::kHalf
                          : scales.dtype() == (type == kQ6_K ? at::kChar : at::kByte),
              "scales of the wrong dtype for ggml type ", type);
  return {values.data_ptr<uint8_t>(), scales.data_ptr(), mins.numel() ? mins.data_ptr() : nullptr,
          supers.numel() ? reinterpret_cast<const uint16_t*>(supers.data_ptr<at::Half>()) : nullptr, K, N, tiles};
}

template <typename F>
void with_type(int64_t type, const F& f) {
  switch (type) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
    case kMXFP4: return f(std::integral_constant<int64_t, kMXFP4>{});
    case kNVFP4: return f(std::integral_constant<int64_t, kNVFP4>{});
    default: TORCH_CHECK(false, "ggml type ", type, " has no GEMV here");
  }
}

at::Tensor skinny_linear_ggml_impl(at::Tensor x, int64_t type, const at::Tensor& values,
                                      const at::Tensor& scales, const at::Tensor& mins,
                                      const at::Tensor& supers, int64_t N, const c10::optional<at::Tensor>& bias,
                                      int64_t* tokens) {
  const Tensors w = check_tensors(type, values, scales, mins, supers, N);
  TORCH_CHECK(x.dtype() == at::kBFloat16 && x.dim() == 2 && x.size(1) == w.K, "bf16 x [M, K] expected");
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto y = kvflow::empty({M, N}, x.options());
  if (M == 0) return y;
  const Activations a = quantize_activations(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, w.K);
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  with_type(type, [&](auto t) {
    constexpr int64_t kType = decltype(t)::value;
    const Gemv<kType> gemv{w, &a, bias.has_value() ? bias_f.data_ptr<float>() : nullptr, yp, M};
    // Grain: a thread streams >= ~64 KiB of weights between synchronisations.
    const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (w.K / kBlock * Gemv<kType>::kBlockBytes));
    kvflow::parallel_tiles(w.tiles, grain, yp, M, N, tokens, [&](int64_t b, int64_t e) { gemv.tiles(b, e); });
  });
  return y;
}

}  // namespace

// x: [M, K] bf16; type: the ggml type id; values, scales, mins, supers: the layout above (empty
// tensors where a type has none); N = out_features -> [M, N] bf16.
at::Tensor skinny_linear_ggml(at::Tensor x, int64_t type, at::Tensor values, at::Tensor scales,
                                 at::Tensor mins, at::Tensor supers, int64_t out_features,
                                 c10::optional<at::Tensor> bias) {
  return skinny_linear_ggml_impl(std::move(x), type, values, scales, mins, supers, out_features, bias, nullptr);
}

at::Tensor skinny_linear_ggml_greedy(at::Tensor x, int64_t type, at::Tensor values, at::Tensor scales,
                                        at::Tensor mins, at::Tensor supers, int64_t out_features,
                                        c10::optional<at::Tensor> bias) {
  auto tokens = kvflow::empty({x.size(0)}, at::kLong);
  skinny_linear_ggml_impl(std::move(x), type, values, scales, mins, supers, out_features, bias,
                          tokens.data_ptr<int64_t>());
  return tokens;
}

at::Tensor dequantize_ggml_rows(int64_t type, at::Tensor values, at::Tensor scales, at::Tensor mins,
                                   at::Tensor supers, int64_t out_features, int64_t n_begin, int64_t n_end) {
  const Tensors w = check_tensors(type, values, scales, mins, supers, out_features);
  TORCH_CHECK(0 <= n_begin && n_begin <= n_end && n_end <= out_features && n_begin % kTileRows == 0,
              "row range out of bounds (or not starting on a 16-row tile)");
  auto out = kvflow::empty({n_end - n_begin, w.K}, values.options().dtype(at::kBFloat16));
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  with_type(type, [&](auto t) {
    constexpr int64_t kType = decltype(t)::value;
    const Gemv<kType> gemv{w, nullptr, nullptr, nullptr, 0};
    gemv.dequantize(n_begin, n_end, o);
  });
  return out;
}
