// Weight-only int8 kernels: decode GEMV on 16-row tiles with VNNI, and row-block dequantization of
// those tiles for prefill.
//
// Weights: q[N, K] int8 (symmetric, per output channel, |q| <= 127), scales[N] fp32:
// W[n, k] = q[n, k] * s[n].
//
// Layout: tiles of 16 output rows (N padded to a multiple of 16 with zero rows, K to a multiple of
// 32 with zero inputs), each weight stored as the unsigned byte q + 128: per tile t and input
// quad p, 64 bytes in which bytes 4l..4l+3 are row 16t + l's inputs 4p..4p+3:
//   tiles[t, p, l, i] = q[16t + l, 4p + i] + 128            ([N_pad / 16, K_pad / 4, 16, 4] uint8)
// so one vpdpbusd multiplies 4 weights of each of 16 rows by the same 4 activations (broadcast)
// and adds them into 16 int32 lanes, lane l = output row 16t + l. No horizontal sums.
//
// skinny_linear_int8: y[M, N] = x[M, K] @ W^T (+ bias) for few rows (decode). The activations are
// quantized to int8 per 32 inputs (activation_quant.h, llama.cpp's q8_0), then per block b:
//   sum_k (q + 128) xq = sum_k q xq + 128 * xsum_b       (exact in int32: 32 * 255 * 127 < 2^31)
//   y[m, n] = s[n] * sum_b dx_{m,b} * (dot_b - 128 * xsum_{m,b})     (+ bias)
// fp32 accumulation in block order whatever M is (batch-invariant).
// Why: the previous kernel widened every int8 weight to bf16 for vdpbf16ps (5 instructions per 32
// weights), which left 8-row decode compute-bound at ~13 GB/s of int8 (benchmarks/NOTES.md); here
// one instruction covers 64 multiply-adds and nothing is widened. The cost: activations rounded to
// int8 per block, measured with `kvflow quant-eval` in NOTES.md. On AVX2 prefill runs this GEMV at
// every M too (kvflow/quant/linear.py): ~1.5x fp32 sgemm on widened blocks.
//
// dequantize_int8_rows: W[n0:n1] as bf16 ([rows, K], q * s rounded once), n0 a multiple of 16, for
// prefill chunks multiplied a block of rows at a time with oneDNN (compute-bound there).

#include <ATen/Parallel.h>
#include "aten_lite.h"
#include "simd.h"

#include "activation_quant.h"
#include "argmax_lanes.h"
#include "row_dispatch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

// VNNI (vpdpbusd) for this file only: every CPU with AVX512-BF16 has it, and kvflow/kernels checks
// the avx512_vnni CPU flag before building. The AVX2 build has no such instruction: simd.h gives
// vpdpbusd's exact sum in 16-bit multiplies (avx512_on_avx2.h).
#if defined(__AVX512F__)
#pragma GCC target("avx512vnni")
#endif

namespace {

constexpr int64_t kTileRows = 16;         // output rows per tile: one per int32 lane
constexpr int64_t kQuadBytes = 64;        // 16 rows x 4 inputs
constexpr int64_t kQuadsPerBlock = 8;     // 32 inputs per activation block
// Activation rows sharing one pass over a tile. AVX2 has 16 registers: 4 rows' dots (2 each)
// beside the quad's weights and magnitudes (4); 8 rows spilled (benchmarks/NOTES.md).
#if defined(__AVX512F__)
constexpr int64_t kMaxRowsPerPass = 8;
#else
constexpr int64_t kMaxRowsPerPass = 4;
#endif
constexpr int64_t kPrefetchBytes = 4096;  // weights prefetched ahead of the loads
constexpr int32_t kWeightOffset = 128;    // stored byte = q + 128

// kBlockScales: one fp16 scale per row and 32 inputs (llama.cpp's Q8_0, read from a GGUF file:
// kvflow/quant/gguf_linear.py), block_scales [N_pad / 16, K_pad / 32, 16], W[n, k] = q s[n, k / 32];
// the block's scale then multiplies its dot with dx_b, and no row scale follows.
template <bool kBlockScales>
struct Gemv {
  const uint8_t* w;    // [N_pad / 16, K_pad / 4, 16, 4]
  const float* scales; // [N] (row scales)
  const uint16_t* block_scales;  // fp16 [N_pad / 16, K_pad / 32, 16] (kBlockScales)
  const kvflow::Int8Activations* x;
  const float* bias;   // [N] or null
  uint16_t* y;         // [M, N] bf16
  int64_t M, N, K_pad;

  // acc[s][m] (lane l: row 16(t + s) + l) = sum_b dx_b * (q[16(t + s) + l] . xq[m0 + m])_b for MB
  // activation rows and the S tiles t .. t + S - 1, whose weight streams are read side by side
  // (kTileStreams); per tile and row the same operations in the same order as for S = 1.
  template <int64_t MB, int64_t S>
  inline void tile_dot(int64_t t, int64_t m0, __m512 (*acc)[kMaxRowsPerPass]) const {
    const int64_t blocks = K_pad / kvflow::kActivationBlock;
    const uint8_t* wt[S];
    for (int64_t s = 0; s < S; ++s) {
      wt[s] = w + (t + s) * (K_pad / 4) * kQuadBytes;
      for (int64_t m = 0; m < MB; ++m) acc[s][m] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i dot[S][MB];
      for (int64_t s = 0; s < S; ++s) {
        const uint8_t* wb = wt[s] + b * kQuadsPerBlock * kQuadBytes;
        for (int64_t line = 0; line < kQuadsPerBlock * kQuadBytes; line += kvflow::kWeightPrefetchStride)
          _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);
        for (int64_t m = 0; m < MB; ++m) dot[s][m] = _mm512_setzero_si512();
      }
      for (int64_t c = 0; c < kQuadsPerBlock; ++c) {
        for (int64_t s = 0; s < S; ++s) {
          const __m512i wq = _mm512_loadu_si512(wt[s] + (b * kQuadsPerBlock + c) * kQuadBytes);
#if !defined(__AVX512F__)
          const kvflow_avx2::SignedWeights ws = kvflow_avx2::signed_weights(wq);
#endif
          for (int64_t m = 0; m < MB; ++m) {
            int32_t x4;  // 4 activations, broadcast to every row's lane
            std::memcpy(&x4, x->q.data() + (m0 + m) * K_pad + b * kvflow::kActivationBlock + 4 * c, 4);
#if defined(__AVX512F__)
            dot[s][m] = _mm512_dpbusd_epi32(dot[s][m], wq, _mm512_set1_epi32(x4));
#else  // AVX2: sum q xq directly (vpsignb + vpmaddubsw, exact; avx512_on_avx2.h), no offset to remove
            dot[s][m] = kvflow_avx2::dpbssd(dot[s][m], ws, _mm512_set1_epi32(x4));
#endif
          }
        }
      }
      __m512 block_scale[S];
      if constexpr (kBlockScales)
        for (int64_t s = 0; s < S; ++s)
          block_scale[s] = _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block_scales + ((t + s) * blocks + b) * kTileRows)));
      for (int64_t m = 0; m < MB; ++m) {
        const int64_t i = (m0 + m) * blocks + b;
        for (int64_t s = 0; s < S; ++s) {
#if defined(__AVX512F__)
          const __m512i exact = _mm512_sub_epi32(dot[s][m], _mm512_set1_epi32(kWeightOffset * x->sums[i]));
#else
          const __m512i exact = dot[s][m];
#endif
          __m512 dx = _mm512_set1_ps(x->scales[i]);
          if constexpr (kBlockScales) dx = _mm512_mul_ps(dx, block_scale[s]);
          acc[s][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), dx, acc[s][m]);
        }
      }
    }
  }

  // y for tiles [t, t + S) at rows [m0, m0 + MB): bf16(acc * s + bias), round to nearest even.
  template <int64_t MB, int64_t S>
  inline void tile_rows(int64_t t, int64_t m0) const {
    __m512 acc[S][kMaxRowsPerPass];
    tile_dot<MB, S>(t, m0, acc);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t n0 = (t + s) * kTileRows, valid = std::min(kTileRows, N - n0);
      const __mmask16 keep = __mmask16((1u << valid) - 1u);
      const __m512 scale = kBlockScales ? _mm512_set1_ps(1.0f) : _mm512_maskz_loadu_ps(keep, scales + n0);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
      for (int64_t m = 0; m < MB; ++m) {
        const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[s][m], scale, b));
        _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0, keep, out);
      }
    }
  }

  void tiles(int64_t t_begin, int64_t t_end) const {
    kvflow::for_tile_groups<kvflow::kTileStreams, kMaxRowsPerPass>(
        t_begin, t_end, M, [&](auto rows, auto streams, int64_t t, int64_t m0) {
          tile_rows<decltype(rows)::value, decltype(streams)::value>(t, m0);
        });
  }
};

// The tiles' K_pad (from their shape), checked against the scales: row scales [N] fp32 or, with
// block scales, fp16 [N_pad / 16, K_pad / 32, 16] for N = out_features.
int64_t check_tiles(const at::Tensor& tiles, const at::Tensor& scales, bool block_scales, int64_t N) {
  TORCH_CHECK(tiles.dtype() == at::kByte && scales.dtype() == (block_scales ? at::kHalf : at::kFloat),
              "uint8 tiles and fp32 row scales (fp16 block scales) expected");
  TORCH_CHECK(tiles.is_contiguous() && scales.is_contiguous(), "contiguous tiles and scales expected");
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == kTileRows && tiles.size(3) == 4 &&
                  (tiles.size(1) * 4) % kvflow::kActivationBlock == 0,
              "tiles must be [N_pad / 16, K_pad / 4, 16, 4] (kvflow/quant/linear.py pack_int8_tiles)");
  const int64_t K_pad = tiles.size(1) * 4;
  TORCH_CHECK(0 < N && N <= tiles.size(0) * kTileRows && N > (tiles.size(0) - 1) * kTileRows,
              "scales do not match the tiles");
  TORCH_CHECK(block_scales ? scales.numel() == tiles.size(0) * (K_pad / kvflow::kActivationBlock) * kTileRows
                           : scales.numel() == N,
              "scales do not match the tiles");
  return K_pad;
}

// skinny_linear_int8 (block_scales: Q8_0); with `tokens` (non-null, [M]), also each row's argmax
// (argmax_lanes.h).
at::Tensor skinny_linear_int8_impl(at::Tensor x, const at::Tensor& tiles, const at::Tensor& scales,
                                      bool block_scales, int64_t N, const c10::optional<at::Tensor>& bias,
                                      int64_t* tokens) {
  const int64_t K_pad = check_tiles(tiles, scales, block_scales, N);
  TORCH_CHECK(x.dtype() == at::kBFloat16 && x.dim() == 2 && x.size(1) <= K_pad &&
                  x.size(1) > K_pad - kvflow::kActivationBlock,
              "bf16 x [M, K] matching the tiles expected");
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto y = kvflow::empty({M, N}, x.options());
  if (M == 0) return y;
  const kvflow::Int8Activations activations =
      kvflow::quantize_activations_int8(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, x.size(1));
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* row_scales = block_scales ? nullptr : scales.data_ptr<float>();
  const uint16_t* fp16_scales = block_scales ? reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()) : nullptr;
  const float* bias_p = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  uint16_t* y_p = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // Grain: a thread streams >= ~64 KiB of weights between synchronisations.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K_pad * kTileRows));
  auto run = [&](auto gemv) {
    kvflow::parallel_tiles(tiles.size(0), grain, y_p, M, N, tokens,
                           [&](int64_t begin, int64_t end) { gemv.tiles(begin, end); });
  };
  if (block_scales)
    run(Gemv<true>{tiles.data_ptr<uint8_t>(), row_scales, fp16_scales, &activations, bias_p, y_p, M, N, K_pad});
  else
    run(Gemv<false>{tiles.data_ptr<uint8_t>(), row_scales, fp16_scales, &activations, bias_p, y_p, M, N, K_pad});
  return y;
}

}  // namespace

// x: [M, K] bf16; tiles: the layout above; scales: [N] fp32; bias: optional [N] -> [M, N] bf16.
at::Tensor skinny_linear_int8(at::Tensor x, at::Tensor tiles, at::Tensor scales,
                                 c10::optional<at::Tensor> bias) {
  const int64_t N = scales.numel();
  return skinny_linear_int8_impl(std::move(x), tiles, scales, false, N, bias, nullptr);
}

at::Tensor skinny_linear_int8_greedy(at::Tensor x, at::Tensor tiles, at::Tensor scales,
                                        c10::optional<at::Tensor> bias) {
  auto tokens = kvflow::empty({x.size(0)}, at::kLong);
  const int64_t N = scales.numel();
  skinny_linear_int8_impl(std::move(x), tiles, scales, false, N, bias, tokens.data_ptr<int64_t>());
  return tokens;
}

// Q8_0 (a GGUF file's): x [M, K] bf16, tiles as above, block_scales fp16 [N_pad / 16, K_pad / 32, 16].
at::Tensor skinny_linear_q8_0(at::Tensor x, at::Tensor tiles, at::Tensor block_scales,
                                 int64_t out_features, c10::optional<at::Tensor> bias) {
  return skinny_linear_int8_impl(std::move(x), tiles, block_scales, true, out_features, bias, nullptr);
}

at::Tensor skinny_linear_q8_0_greedy(at::Tensor x, at::Tensor tiles, at::Tensor block_scales,
                                        int64_t out_features, c10::optional<at::Tensor> bias) {
  auto tokens = kvflow::empty({x.size(0)}, at::kLong);
  skinny_linear_int8_impl(std::move(x), tiles, block_scales, true, out_features, bias, tokens.data_ptr<int64_t>());
  return tokens;
}

namespace {

// Rows [n_begin, n_end) of q * s as bf16 [n_end - n_begin, K] (K = in_features <= K_pad), n_begin a
// multiple of 16; s a row's scale, or (block scales) its scale of each 32 inputs.
at::Tensor dequantize_rows(const at::Tensor& tiles, const at::Tensor& scales, bool block_scales, int64_t N,
                              int64_t in_features, int64_t n_begin, int64_t n_end) {
  const int64_t K_pad = check_tiles(tiles, scales, block_scales, N), K = in_features;
  TORCH_CHECK(0 < K && K <= K_pad && K > K_pad - kvflow::kActivationBlock, "in_features does not match the tiles");
  TORCH_CHECK(0 <= n_begin && n_begin <= n_end && n_end <= N && n_begin % kTileRows == 0,
              "row range out of bounds (or not starting on a 16-row tile)");
  auto out = kvflow::empty({n_end - n_begin, K}, tiles.options().dtype(at::kBFloat16));
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint8_t* w = tiles.data_ptr<uint8_t>();
  const float* s = block_scales ? nullptr : scales.data_ptr<float>();
  const at::Half* bs = block_scales ? scales.data_ptr<at::Half>() : nullptr;
  const int64_t blocks = K_pad / kvflow::kActivationBlock;
  const int64_t t_begin = n_begin / kTileRows, t_end = (n_end + kTileRows - 1) / kTileRows;
  at::parallel_for(t_begin, t_end, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid = std::min(kTileRows, n_end - t * kTileRows);
      for (int64_t l = 0; l < valid; ++l) {  // row 16t + l: its 4 bytes of every quad
        const int64_t n = t * kTileRows + l;
        const uint8_t* row = w + t * (K_pad / 4) * kQuadBytes + 4 * l;
        uint16_t* dst = o + (n - n_begin) * K;
        for (int64_t k = 0; k < K; k += 16) {  // 4 quads = 16 inputs per step
          const float scale = block_scales ? float(bs[(t * blocks + k / kvflow::kActivationBlock) * kTileRows + l]) : s[n];
          alignas(16) uint8_t bytes[16];
          for (int64_t j = 0; j < 4; ++j) std::memcpy(bytes + 4 * j, row + (k / 4 + j) * kQuadBytes, 4);
          const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes))),
                                             _mm512_set1_epi32(kWeightOffset));
          const int64_t left = K - k;
          const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
          // Round to nearest even as torch's fp32 -> bf16 cast does.
          _mm256_mask_storeu_epi16(
              dst + k, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(scale))));
        }
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor dequantize_int8_rows(at::Tensor tiles, at::Tensor scales, int64_t in_features, int64_t n_begin,
                                   int64_t n_end) {
  return dequantize_rows(tiles, scales, false, scales.numel(), in_features, n_begin, n_end);
}

at::Tensor dequantize_q8_0_rows(at::Tensor tiles, at::Tensor block_scales, int64_t in_features,
                                   int64_t out_features, int64_t n_begin, int64_t n_end) {
  return dequantize_rows(tiles, block_scales, true, out_features, in_features, n_begin, n_end);
}
