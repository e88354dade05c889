// Weight-only int4 kernels (group-wise, asymmetric): decode GEMV on the nibble-packed matrix, and
// row-block dequantization for prefill.
//
// Weights: q[N, K] in 0..15, a bf16 scale s and minimum z per group of g inputs (g a multiple of
// 32): W[n, k] = q[n, k] * s[n, k / g] + z[n, k / g]. Packed in this kernel's own layout, blocks of
// 128 inputs (one 64-byte line) per row: u16 lane i of block b holds
//   q[128b + i] | q[128b + 32 + i] << 4 | q[128b + 64 + i] << 8 | q[128b + 96 + i] << 12,
// so chunk c (32 consecutive weights) is nibble c of all 32 lanes: one shift and one mask away.
// ([N, K / 2] bytes, little-endian lanes; K must be a multiple of 128.)
//
// skinny_linear_int4: y[M, N] = x[M, K] @ W^T (+ bias) for few rows (decode), streaming half a
// byte per weight. The widening costs no conversion: for 0 <= v < 128 the bf16 bit pattern
// 0x4300 | v is exactly 128 + v (exponent 2^7, the 7 mantissa bits hold v), so a nibble becomes a
// bf16 with one ternary-logic instruction. Per group j the AVX512-BF16 dot product gives
// d_j = x . (128 + q) in fp32, and
//   y = sum_j s_j * d_j + (z_j - 128 s_j) * sum_{k in j} x_k
// (the group sums of x are computed once per call). The 128 offset cancels in fp32 at a cost of
// ~4 of its 24 bits, far below the bf16 output rounding.
//
// dequantize_int4_rows: W[n0:n1] as bf16 (q * s + z in fp32, rounded once) in the plain [rows, K]
// layout, for prefill chunks multiplied a block at a time with oneDNN, as for int8 (gemv_int8.cpp).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "gemv_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace kvflow::gemv;

constexpr int64_t kChunk = kLanes;       // weights per bf16 register
constexpr int64_t kBlock = 128;          // weights per packed 64-byte line (4 chunks)
constexpr int64_t kPrefetchBytes = 512;  // packed weights prefetched ahead of the loads
constexpr float kOffset = 128.0f;        // the value 0x4300 | v stands for, less v

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Chunk c of a packed block -> 32 bf16 holding 128 + q, in element order:
// ((lanes >> 4c) & 0x000F) | 0x4300, the mask-and-or as ternary-logic table 0xEA = (A & B) | C.
template <int64_t C>
inline __m512bh widen_chunk(__m512i lanes) {
  const __m512i shifted = C == 0 ? lanes : _mm512_srli_epi16(lanes, 4 * C);
  return (__m512bh)_mm512_ternarylogic_epi32(shifted, _mm512_set1_epi16(0x000F), _mm512_set1_epi16(0x4300), 0xEA);
}

struct Gemv {
  const uint8_t* w;       // [N, K / 2]
  const uint16_t* scales; // [N, K / g] bf16
  const uint16_t* mins;   // [N, K / g] bf16
  const uint16_t* x;      // [M, K] bf16
  const float* xsum;      // [M, K / g]
  const float* bias;
  uint16_t* y;            // [M, N] bf16
  int64_t M, K, N, g;

  // out[m] = row n of W dotted with x[m], for MB rows of x. Groups' dot products are independent
  // chains (each starts from zero), so the out-of-order core overlaps consecutive groups; their
  // scaled sums alternate between two accumulators.
  template <int64_t MB, int64_t C>
  inline void chunk_dot(__m512i lanes, const uint16_t* xm, int64_t k, __m512* dot) const {
    const __m512bh wv = widen_chunk<C>(lanes);
    for (int64_t m = 0; m < MB; ++m) dot[m] = _mm512_dpbf16_ps(dot[m], wv, load_bf16(xm + m * K + k + C * kChunk));
  }

  // out[m] = row n of W dotted with x[m], for MB rows of x. Each group's dot product is its own
  // chain, restarted from zero, so the out-of-order core overlaps consecutive groups; the scaled
  // group sums alternate between two accumulators.
  template <int64_t MB>
  inline void row_dot(int64_t n, const uint16_t* xm, const float* xs, float* out) const {
    const int64_t groups = K / g, chunks_per_group = g / kChunk;
    const uint8_t* wn = w + n * (K / 2);
    const uint16_t* sn = scales + n * groups;
    const uint16_t* zn = mins + n * groups;
    __m512 total[MB][2], dot[MB];
    float corr[MB];
    for (int64_t m = 0; m < MB; ++m) {
      total[m][0] = total[m][1] = dot[m] = _mm512_setzero_ps();
      corr[m] = 0.0f;
    }
    int64_t j = 0, left_in_group = chunks_per_group;
    auto close_group_if_done = [&]() {
      if (--left_in_group) return;
      const float s = bf16_to_float(sn[j]);
      const float z = bf16_to_float(zn[j]) - kOffset * s;
      const __m512 sv = _mm512_set1_ps(s);
      for (int64_t m = 0; m < MB; ++m) {
        total[m][j & 1] = _mm512_fmadd_ps(dot[m], sv, total[m][j & 1]);
        dot[m] = _mm512_setzero_ps();
        corr[m] += z * xs[m * groups + j];
      }
      ++j;
      left_in_group = chunks_per_group;
    };
    for (int64_t k = 0; k < K; k += kBlock) {
      _mm_prefetch(reinterpret_cast<const char*>(wn + k / 2 + kPrefetchBytes), _MM_HINT_T0);
      const __m512i lanes = _mm512_loadu_si512(wn + k / 2);
      chunk_dot<MB, 0>(lanes, xm, k, dot);
      close_group_if_done();
      chunk_dot<MB, 1>(lanes, xm, k, dot);
      close_group_if_done();
      chunk_dot<MB, 2>(lanes, xm, k, dot);
      close_group_if_done();
      chunk_dot<MB, 3>(lanes, xm, k, dot);
      close_group_if_done();
    }
    for (int64_t m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(total[m][0], total[m][1])) + corr[m];
  }

  void rows(int64_t n_begin, int64_t n_end) const {
    const int64_t groups = K / g;
    const auto dot = [&](int64_t n, auto mb, int64_t m0, float* out) {
      row_dot<decltype(mb)::value>(n, x + m0 * K, xsum + m0 * groups, out);
    };
    const auto finish = [&](int64_t n, float d) { return bias ? d + bias[n] : d; };
    gemv_rows(M, N, n_begin, n_end, dot, finish, y);
  }
};

void check_weights(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& mins, int64_t g) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && scales.dtype() == torch::kBFloat16 && mins.dtype() == torch::kBFloat16,
              "uint8 packed weights and bf16 scales/mins expected");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(), "contiguous weights expected");
  const int64_t K = packed.size(1) * 2;
  TORCH_CHECK(g % kChunk == 0 && K % g == 0 && K % kBlock == 0,
              "group size must be a multiple of 32 dividing in_features, a multiple of 128");
  TORCH_CHECK(scales.size(0) == packed.size(0) && scales.size(1) == K / g && mins.sizes() == scales.sizes(),
              "scales/mins must be [out, in / group]");
}

// Chunk C of a block at input k: 32 weights (128 + q) * s + (z - 128 s) -> bf16 at out_row + k + 32C.
template <int64_t C>
inline void dequantize_chunk(__m512i lanes, const uint16_t* s, const uint16_t* z, int64_t row_group0, int64_t k,
                             int64_t g, uint16_t* out_row) {
  const int64_t kc = k + C * kChunk, j = row_group0 + kc / g;
  const float sj = bf16_to_float(s[j]);
  const __m512 sv = _mm512_set1_ps(sj), zv = _mm512_set1_ps(bf16_to_float(z[j]) - kOffset * sj);
  const __m512i wide = (__m512i)widen_chunk<C>(lanes);  // 32 bf16: element 2i low, 2i + 1 high of lane i
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(wide, _mm512_set1_epi32(int(0xFFFF0000))));
  const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(even, sv, zv)));
  const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(odd, sv, zv)));
  _mm512_storeu_si512(out_row + kc, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
}

}  // namespace

// x: [M, K] bf16; packed: [N, K / 2] uint8; scales, mins: [N, K / g] bf16; bias: optional [N]
// -> [M, N] bf16.
torch::Tensor skinny_linear_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                                 int64_t group_size, c10::optional<torch::Tensor> bias) {
  check_weights(packed, scales, mins, group_size);
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.size(1) == packed.size(1) * 2, "bf16 x [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), groups = K / group_size;
  // Group sums of x in fp32, [M, K / g]: dot products with a vector of bf16 ones (exact products).
  std::vector<float> xsum(M * groups);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  for (int64_t i = 0; i < M * groups; ++i) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < group_size; c += kChunk) acc = _mm512_dpbf16_ps(acc, load_bf16(xp + i * group_size + c), ones);
    xsum[i] = _mm512_reduce_add_ps(acc);
  }
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(torch::kFloat32).contiguous();
  const Gemv gemv{packed.data_ptr<uint8_t>(),
                  reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(mins.data_ptr<at::BFloat16>()),
                  xp,
                  xsum.data(),
                  bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
                  reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                  M, K, N, group_size};
  // Grain: a thread streams >= ~64 KiB of packed weights between synchronisations.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K / 2));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { gemv.rows(begin, end); });
  return y;
}

// Rows [n_begin, n_end) of q * s + z as bf16 [n_end - n_begin, K].
torch::Tensor dequantize_int4_rows(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                                   int64_t group_size, int64_t n_begin, int64_t n_end) {
  check_weights(packed, scales, mins, group_size);
  TORCH_CHECK(0 <= n_begin && n_begin <= n_end && n_end <= packed.size(0), "row range out of bounds");
  const int64_t K = packed.size(1) * 2, groups = K / group_size, rows = n_end - n_begin;
  auto out = torch::empty({rows, K}, scales.options());
  const uint8_t* w = packed.data_ptr<uint8_t>() + n_begin * (K / 2);
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()) + n_begin * groups;
  const auto* z = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::BFloat16>()) + n_begin * groups;
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t k = 0; k < K; k += kBlock) {
        const __m512i lanes = _mm512_loadu_si512(w + r * (K / 2) + k / 2);
        dequantize_chunk<0>(lanes, s, z, r * groups, k, group_size, o + r * K);
        dequantize_chunk<1>(lanes, s, z, r * groups, k, group_size, o + r * K);
        dequantize_chunk<2>(lanes, s, z, r * groups, k, group_size, o + r * K);
        dequantize_chunk<3>(lanes, s, z, r * groups, k, group_size, o + r * K);
      }
    }
  });
  return out;
}
