// Weight-only int4 kernels (group-wise, asymmetric): decode GEMV on the nibble-packed matrix, and
// row-block dequantization for prefill.
//
// Weights: q[N, K] in 0..15, a bf16 scale s and minimum z per group of g = 32, 64 or 128 inputs:
// W[n, k] = q[n, k] * s[n, k / g] + z[n, k / g]. K must be a multiple of g.
//
// Layout: tiles of 16 output rows (N padded to a multiple of 16 with zero rows). Per tile t, per
// block of 32 inputs b and quarter c (0..3), 64 bytes in which bytes 4l..4l+3 belong to row
// 16t + l:   byte 4l + i = q[16t + l][32b + 8c + i] | q[16t + l][32b + 8c + 4 + i] << 4.
// So one AND gives, in 32-bit lane l, 4 consecutive weights of row l as bytes, and a shift and an
// AND the next 4: the 16 lanes of a register are 16 output rows. packed: [N_pad / 16, 8K] uint8;
// scales and mins: [N_pad / 16, K / g, 16] bf16 (tile t, group j, row l), one stream per tile.
// (llama.cpp repacks q4_0 for its AVX kernels by interleaving rows too; this layout is kvflow's.)
//
// skinny_linear_int4: y[M, N] = x[M, K] @ W^T (+ bias) for few rows (decode). The activations are
// quantized once per call to int8 per 32 inputs (symmetric, dx_b = max|x_b| / 127, round half to
// even), as llama.cpp does for q4 x q8; then one VNNI instruction (vpdpbusd) multiplies 4 weights
// of each of 16 rows by the same 4 activations (broadcast) and sums them into 16 int32 lanes:
//   y[m, n] = sum_b s_{n, j(b)} * dx_{m, b} * (q_{n, b} . xq_{m, b})  +  sum_j z_{n, j} * xsum_{m, j}
// with exact integer dot products, fp32 scaling and accumulation (in block order, whatever M is:
// batch-invariant), and exact fp32 group sums of x. No horizontal reduction: lane l is row l.
// About 33 vector instructions per 512 weights at one activation row, a third of what widening
// nibbles to bf16 for vdpbf16ps needed, which left the GEMV compute-bound at g = 32 (NOTES.md).
// The cost of int8 activations is measured in benchmarks/NOTES.md. Prefill (compute-bound) runs
// this GEMV at every M on AVX2, where it beats fp32 sgemm on widened blocks ~1.5x (vpmaddubsw: 32
// products per instruction), and multiplies bf16 activations by dequantized row blocks where
// oneDNN has a bf16 GEMM (kvflow/quant/linear.py).
//
// dequantize_int4_rows: W[n0:n1] as bf16 (q * s + z in fp32, rounded once) in the plain [rows, K]
// layout, n0 a multiple of 16, for prefill chunks multiplied a block at a time with oneDNN.

#include <ATen/Parallel.h>
#include "aten_lite.h"
#include "simd.h"

#include "activation_quant.h"
#include "argmax_lanes.h"
#include "row_dispatch.h"
#include "bf16_utils.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

// VNNI (vpdpbusd) for this file only: every CPU with AVX512-BF16 has it, and kvflow/kernels checks
// the avx512_vnni CPU flag before building. The AVX2 build has no such instruction: simd.h gives
// vpdpbusd's exact sum in 16-bit multiplies (avx512_on_avx2.h).
#if defined(__AVX512F__)
#pragma GCC target("avx512vnni")
#endif

namespace {

constexpr int64_t kTileRows = 16;          // output rows per tile: one per fp32/int32 lane
constexpr int64_t kXBlock = 32;            // inputs per activation scale (llama.cpp's q8_0 block)
constexpr int64_t kTileBlockBytes = 256;   // 16 rows x 32 int4 weights
// Activation rows sharing one pass over the weights. AVX2 has 16 registers: 4 rows keep their
// int16 dots (2 each) and the tile's nibbles in registers, 8 spilled (benchmarks/NOTES.md).
#if defined(__AVX512F__)
constexpr int64_t kMaxRowsPerPass = 8;
#else
constexpr int64_t kMaxRowsPerPass = 4;
#endif
constexpr int64_t kPrefetchBytes = 1024;   // packed weights prefetched ahead of the loads

// Tiles one thread streams side by side at `rows` activation rows per pass: two at up to 2 rows
// where simd.h's rule allows several (AVX-512), else one. Not simd.h's four: this tile does more
// work per byte (nibbles unpacked, group scales and minima), and single-stream int4 g32 decode steps
// of the 0.5B shape on an AMX Xeon, alternated, took 13.5-13.8 ms with one stream, 14.4-14.9 with
// four, 12.5-13.2 with two against 13.2-13.7 with one (four pairs; benchmarks/NOTES.md, session 16).
constexpr int64_t kInt4TileStreams(int64_t rows) {
  return kvflow::kTileStreams(rows) > 1 && rows <= 2 ? 2 : 1;
}

inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The activations as the GEMV reads them, built once per call.
struct QuantizedActivations {
  std::vector<int8_t> q;      // [M, K]: round(x / dx_b), |q| <= 127
  std::vector<float> scales;  // [M, K / 32]: dx_b
  std::vector<float> sums;    // [M, K / g]: exact sums of x over each weight group
};

QuantizedActivations quantize_activations(const uint16_t* x, int64_t M, int64_t K, int64_t g) {
  kvflow::Int8Activations q8 = kvflow::quantize_activations_int8(x, M, K);  // K % 32 == 0 here
  QuantizedActivations a{std::move(q8.q), std::move(q8.scales), std::vector<float>(M * (K / g))};
  // 16 lanes of partial sums per group, then their sum: a prefill chunk's M x K inputs in one
  // scalar chain took ~3 ms per down_proj at M = 512 on one thread.
  at::parallel_for(0, M, kvflow::kQuantizeGrainRows, [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m)
      for (int64_t j = 0; j < K / g; ++j) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < g; i += 16) sum = _mm512_add_ps(sum, load_bf16x16(x + m * K + j * g + i));
        a.sums[m * (K / g) + j] = _mm512_reduce_add_ps(sum);
      }
  });
  return a;
}

struct Gemv {
  const uint8_t* w;        // [N_pad / 16, 8K]
  const uint16_t* scales;  // [N_pad / 16, K / g, 16] bf16
  const uint16_t* mins;    // [N_pad / 16, K / g, 16] bf16
  const QuantizedActivations* x;
  const float* bias;  // [N] or null
  uint16_t* y;        // [M, N] bf16
  int64_t M, K, N, g;

  // acc[s][m] (lane l: row 16(t + s) + l) = W[16(t + s) + l] . x[m0 + m] for MB activation rows
  // and the S tiles t .. t + S - 1, whose weight streams are read side by side
  // (kInt4TileStreams); per tile and row the same operations in the same order as for S = 1.
  template <int64_t MB, int64_t S>
  inline void tile_dot(int64_t t, int64_t m0, __m512 (*acc)[kMaxRowsPerPass]) const {
    const int64_t groups = K / g, blocks = K / kXBlock, blocks_per_group = g / kXBlock;
    const uint8_t* wt[S];
    const uint16_t* st[S];
    const uint16_t* zt[S];
    __m512 scale[S];
    for (int64_t i = 0; i < S; ++i) {
      wt[i] = w + (t + i) * (8 * K);
      st[i] = scales + (t + i) * groups * kTileRows;
      zt[i] = mins + (t + i) * groups * kTileRows;
      scale[i] = _mm512_setzero_ps();
      for (int64_t m = 0; m < MB; ++m) acc[i][m] = _mm512_setzero_ps();
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t j = b / blocks_per_group;
      __m512i dot[S][MB];  // AVX-512: int32 lanes; AVX2: int16 pair sums until the block's end
      for (int64_t i = 0; i < S; ++i) {
        if (b % blocks_per_group == 0) {  // a new group: its scales, and sum_j z_j * xsum_j
          scale[i] = load_bf16x16(st[i] + j * kTileRows);
          const __m512 z = load_bf16x16(zt[i] + j * kTileRows);
          for (int64_t m = 0; m < MB; ++m)
            acc[i][m] = _mm512_fmadd_ps(z, _mm512_set1_ps(x->sums[(m0 + m) * groups + j]), acc[i][m]);
        }
        const uint8_t* wb = wt[i] + b * kTileBlockBytes;
        for (int64_t line = 0; line < kTileBlockBytes; line += kvflow::kWeightPrefetchStride)
          _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);
        for (int64_t m = 0; m < MB; ++m) dot[i][m] = _mm512_setzero_si512();
      }
#if !defined(__AVX512F__)
      static_assert(2 * 4 <= kvflow_avx2::kNibbleProductsInInt16, "a block's 8 products must fit int16");
#endif
      for (int64_t c = 0; c < 4; ++c) {
        for (int64_t i = 0; i < S; ++i) {
          const __m512i packed = _mm512_loadu_si512(wt[i] + b * kTileBlockBytes + 64 * c);
          const __m512i lo = _mm512_and_si512(packed, nibble);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
          for (int64_t m = 0; m < MB; ++m) {
            const int8_t* xq = x->q.data() + (m0 + m) * K + b * kXBlock + 8 * c;
            int32_t x_lo, x_hi;  // 4 activations each, broadcast to every row's lane
            std::memcpy(&x_lo, xq, 4);
            std::memcpy(&x_hi, xq + 4, 4);
#if defined(__AVX512F__)
            dot[i][m] = _mm512_dpbusd_epi32(dot[i][m], lo, _mm512_set1_epi32(x_lo));
            dot[i][m] = _mm512_dpbusd_epi32(dot[i][m], hi, _mm512_set1_epi32(x_hi));
#else  // the same sums: the block's 8 nibble x int8 products fit int16 exactly (avx512_on_avx2.h)
            dot[i][m] = kvflow_avx2::maddubs_add_epi16(dot[i][m], lo, _mm512_set1_epi32(x_lo));
            dot[i][m] = kvflow_avx2::maddubs_add_epi16(dot[i][m], hi, _mm512_set1_epi32(x_hi));
#endif
          }
        }
      }
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t m = 0; m < MB; ++m) {
#if !defined(__AVX512F__)
          dot[i][m] = kvflow_avx2::widen_pair_sums(dot[i][m]);
#endif
          const __m512 sdx = _mm512_mul_ps(scale[i], _mm512_set1_ps(x->scales[(m0 + m) * blocks + b]));
          acc[i][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][m]), sdx, acc[i][m]);
        }
      }
    }
  }

  // y for tiles [t, t + S) at rows [m0, m0 + MB): bf16(acc + bias), round to nearest even.
  template <int64_t MB, int64_t S>
  inline void tile_rows(int64_t t, int64_t m0) const {
    __m512 acc[S][kMaxRowsPerPass];
    tile_dot<MB, S>(t, m0, acc);
    for (int64_t i = 0; i < S; ++i) {
      const int64_t n0 = (t + i) * kTileRows, valid = std::min(kTileRows, N - n0);
      const __mmask16 keep = __mmask16((1u << valid) - 1u);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
      for (int64_t m = 0; m < MB; ++m) {
        const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][m], b));
        _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0, keep, out);
      }
    }
  }

  void tiles(int64_t t_begin, int64_t t_end) const {
    kvflow::for_tile_groups<kInt4TileStreams, kMaxRowsPerPass>(
        t_begin, t_end, M, [&](auto rows, auto streams, int64_t t, int64_t m0) {
          tile_rows<decltype(rows)::value, decltype(streams)::value>(t, m0);
        });
  }
};

struct Weights {
  int64_t N, K, tiles, groups;
};

Weights check_weights(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins, int64_t g,
                      int64_t N) {
  TORCH_CHECK(packed.dtype() == at::kByte && scales.dtype() == at::kBFloat16 && mins.dtype() == at::kBFloat16,
              "uint8 packed weights and bf16 scales/mins expected");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(), "contiguous weights expected");
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) % (8 * kXBlock) == 0, "packed must be [N_pad / 16, 8K]");
  const int64_t K = packed.size(1) / 8, tiles = packed.size(0);
  TORCH_CHECK((g == 32 || g == 64 || g == 128) && K % g == 0, "native int4: group size 32, 64 or 128 dividing K");
  TORCH_CHECK(0 < N && N <= tiles * kTileRows && N > (tiles - 1) * kTileRows, "N does not match the tiles");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == tiles && scales.size(1) == K / g && scales.size(2) == kTileRows &&
                  mins.sizes() == scales.sizes(),
              "scales/mins must be [N_pad / 16, K / g, 16]");
  return {N, K, tiles, K / g};
}

// skinny_linear_int4; with `tokens` (non-null, [M]), also each row's argmax (argmax_lanes.h).
at::Tensor skinny_linear_int4_impl(at::Tensor x, const at::Tensor& packed, const at::Tensor& scales,
                                      const at::Tensor& mins, int64_t group_size, int64_t out_features,
                                      const c10::optional<at::Tensor>& bias, int64_t* tokens) {
  const Weights wt = check_weights(packed, scales, mins, group_size, out_features);
  TORCH_CHECK(x.dtype() == at::kBFloat16 && x.dim() == 2 && x.size(1) == wt.K, "bf16 x [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0);
  const QuantizedActivations activations =
      quantize_activations(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, wt.K, group_size);
  auto y = kvflow::empty({M, wt.N}, x.options());
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const Gemv gemv{packed.data_ptr<uint8_t>(),
                  reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(mins.data_ptr<at::BFloat16>()),
                  &activations,
                  bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
                  reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                  M, wt.K, wt.N, group_size};
  // Grain: a thread streams >= ~64 KiB of packed weights between synchronisations.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (8 * wt.K));
  kvflow::parallel_tiles(wt.tiles, grain, gemv.y, M, wt.N, tokens,
                         [&](int64_t begin, int64_t end) { gemv.tiles(begin, end); });
  return y;
}

}  // namespace

// x: [M, K] bf16; packed, scales, mins: the tile layout above; N = out_features; bias: optional
// [N] -> [M, N] bf16.
at::Tensor skinny_linear_int4(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor mins,
                                 int64_t group_size, int64_t out_features, c10::optional<at::Tensor> bias) {
  return skinny_linear_int4_impl(std::move(x), packed, scales, mins, group_size, out_features, bias, nullptr);
}

at::Tensor skinny_linear_int4_greedy(at::Tensor x, at::Tensor packed, at::Tensor scales,
                                        at::Tensor mins, int64_t group_size, int64_t out_features,
                                        c10::optional<at::Tensor> bias) {
  auto tokens = kvflow::empty({x.size(0)}, at::kLong);
  skinny_linear_int4_impl(std::move(x), packed, scales, mins, group_size, out_features, bias,
                          tokens.data_ptr<int64_t>());
  return tokens;
}

// Rows [n_begin, n_end) of q * s + z as bf16 [n_end - n_begin, K]; n_begin a multiple of 16.
at::Tensor dequantize_int4_rows(at::Tensor packed, at::Tensor scales, at::Tensor mins,
                                   int64_t group_size, int64_t out_features, int64_t n_begin, int64_t n_end) {
  const Weights wt = check_weights(packed, scales, mins, group_size, out_features);
  TORCH_CHECK(0 <= n_begin && n_begin <= n_end && n_end <= wt.N && n_begin % kTileRows == 0,
              "row range out of bounds (or not starting on a 16-row tile)");
  const int64_t K = wt.K, g = group_size, rows = n_end - n_begin;
  auto out = kvflow::empty({rows, K}, scales.options());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const auto* z = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::BFloat16>());
  // Per 16-lane register of one tile: lane l is row l; its 4 bytes expand to 4 consecutive weights.
  // Rows 4r..4r+3 sit in 128-bit lane r, so each 128-bit lane is widened separately to 16 floats
  // (4 rows x 4 weights) whose scales are lanes [4r x4, 4r+1 x4, 4r+2 x4, 4r+3 x4] of the tile's.
  const __m512i expand[4] = {
      _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
      _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4),
      _mm512_set_epi32(11, 11, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8),
      _mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12)};
  const int64_t t_begin = n_begin / kTileRows, t_end = (n_end + kTileRows - 1) / kTileRows;
  at::parallel_for(t_begin, t_end, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t tile[kTileRows * 8];  // one quarter: 16 rows x 8 weights, row-major
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid = std::min(kTileRows, n_end - t * kTileRows);
      for (int64_t b = 0; b < K / kXBlock; ++b) {
        const int64_t j = b * kXBlock / g;
        const __m512 sv = load_bf16x16(s + (t * (K / g) + j) * kTileRows);
        const __m512 zv = load_bf16x16(z + (t * (K / g) + j) * kTileRows);
        for (int64_t c = 0; c < 4; ++c) {
          const __m512i packed_q = _mm512_loadu_si512(w + t * (8 * K) + b * kTileBlockBytes + 64 * c);
          const __m512i halves[2] = {_mm512_and_si512(packed_q, _mm512_set1_epi8(0x0F)),
                                     _mm512_and_si512(_mm512_srli_epi16(packed_q, 4), _mm512_set1_epi8(0x0F))};
          for (int64_t h = 0; h < 2; ++h) {  // h = 0: weights 8c..8c+3 of each row, h = 1: 8c+4..8c+7
            for (int64_t r = 0; r < 4; ++r) {
              const __m128i bytes = r == 0 ? _mm512_extracti32x4_epi32(halves[h], 0)
                                    : r == 1 ? _mm512_extracti32x4_epi32(halves[h], 1)
                                    : r == 2 ? _mm512_extracti32x4_epi32(halves[h], 2)
                                             : _mm512_extracti32x4_epi32(halves[h], 3);
              const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
              const __m512 v = _mm512_fmadd_ps(q, _mm512_permutexvar_ps(expand[r], sv), _mm512_permutexvar_ps(expand[r], zv));
              alignas(32) uint16_t vals[16];
              _mm256_store_si256(reinterpret_cast<__m256i*>(vals), (__m256i)_mm512_cvtneps_pbh(v));
              for (int64_t l = 0; l < 4; ++l) std::memcpy(tile + (4 * r + l) * 8 + 4 * h, vals + 4 * l, 8);
            }
          }
          const int64_t k = b * kXBlock + 8 * c;
          for (int64_t l = 0; l < valid; ++l) std::memcpy(o + (t * kTileRows + l - n_begin) * K + k, tile + l * 8, 16);
        }
      }
    }
  });
  return out;
}
