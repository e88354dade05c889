// Weight-only int8 kernels: decode GEMV on the packed int8 matrix, and row-block dequantization
// for prefill.
//
// Weights: q[N, K] int8 (symmetric, per output channel), scales[N] fp32: W[n, k] = q[n, k] * s[n].
//
// skinny_linear_int8: y[M, N] = x[M, K] @ W^T (+ bias) for few rows (decode). Bandwidth-bound, so
// the point is to stream 1 byte per weight instead of 2. PyTorch's `_weight_int8pack_mm` reads
// ~18 GB/s of int8 at M=1 here (benchmarks/NOTES.md), slower than the bf16 GEMV reads twice the
// bytes. Each weight is widened in registers (int8 -> int32 -> fp32 -> bf16, exact: |q| <= 127
// has 7 significant bits and bf16 keeps 8) and dotted with the bf16 activations by AVX512-BF16
// (vdpbf16ps, fp32 accumulation); the row's scale is applied once to the finished dot product.
// So the result is x . q exactly summed in fp32, then * s: the same numbers a bf16 model with
// weights q * s would give, less one rounding of the weights.
//
// dequantize_int8_rows: W[n0:n1] as bf16, for prefill chunks (M large, compute-bound): the caller
// multiplies a block of rows at a time with oneDNN's bf16 GEMM, so no whole matrix is ever
// materialized and the block stays in cache between dequantization and use.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16_utils.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kMaxM = 4;             // activation rows per pass over a weight row
constexpr int64_t kLanes = 32;           // bf16 lanes per 512-bit register
constexpr int64_t kUnroll = 4;           // independent accumulators per activation row
constexpr int64_t kPrefetchBytes = 1024; // int8 weights prefetched ahead of the loads

// 32 int8 weights at p (the first `n` of them, the rest read as 0) -> 32 bf16 in one register,
// element order preserved: low half from weights 0..15, high half from 16..31.
inline __m512bh widen_int8_to_bf16(const int8_t* p, int64_t n) {
  const __mmask16 m0 = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1u);
  const int64_t n1 = n - 16;
  const __mmask16 m1 = n1 >= 16 ? __mmask16(0xffff) : n1 <= 0 ? __mmask16(0) : __mmask16((1u << n1) - 1u);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, p)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, p + 16)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

inline __m512bh widen_int8_to_bf16_full(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// out[m] = dot(q_row, x[m]) for MB activation rows; q_row is streamed once, front to back, and each
// widened chunk serves all MB rows. kUnroll independent accumulators per row hide the dot-product
// latency. Batch invariance: a row's sum is accumulated in the same order whatever MB and M are,
// so a token's result does not depend on what else is in the batch (speculative verification
// reproduces plain decoding bit for bit; tests/spec_decode).
template <int64_t MB>
inline void row_dot(const int8_t* w, const uint16_t* x, int64_t K, float* out) {
  __m512 acc[MB][kUnroll];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t u = 0; u < kUnroll; ++u) acc[m][u] = _mm512_setzero_ps();
  const __mmask32 all = ~__mmask32(0);
  int64_t k = 0;
  for (; k + kLanes * kUnroll <= K; k += kLanes * kUnroll) {
    for (int64_t line = 0; line < kLanes * kUnroll; line += 64)  // one prefetch per 64-byte line
      _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetchBytes + line), _MM_HINT_T0);
    for (int64_t u = 0; u < kUnroll; ++u) {
      const __m512bh wv = widen_int8_to_bf16_full(w + k + u * kLanes);
      for (int64_t m = 0; m < MB; ++m)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, load_bf16(x + m * K + k + u * kLanes, all));
    }
  }
  for (; k < K; k += kLanes) {  // tail: whole or partial 32-element chunks
    const int64_t left = K - k;
    const __mmask32 mask = left >= kLanes ? all : (__mmask32(1) << left) - 1;
    const __m512bh wv = widen_int8_to_bf16(w + k, left);
    for (int64_t m = 0; m < MB; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, load_bf16(x + m * K + k, mask));
  }
  for (int64_t m = 0; m < MB; ++m) {
    __m512 total = acc[m][0];
    for (int64_t u = 1; u < kUnroll; ++u) total = _mm512_add_ps(total, acc[m][u]);
    out[m] = _mm512_reduce_add_ps(total);
  }
}

struct Gemv {
  const int8_t* w;
  const float* scales;
  const uint16_t* x;
  const float* bias;
  uint16_t* y;
  int64_t M, K, N;

  void rows(int64_t n_begin, int64_t n_end) const {
    float out[kMaxM];
    for (int64_t n = n_begin; n < n_end; ++n) {
      const int8_t* wn = w + n * K;
      const float s = scales[n], b = bias ? bias[n] : 0.0f;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
        const int64_t mb = std::min(kMaxM, M - m0);
        const uint16_t* xm = x + m0 * K;
        switch (mb) {
          case 1: row_dot<1>(wn, xm, K, out); break;
          case 2: row_dot<2>(wn, xm, K, out); break;
          case 3: row_dot<3>(wn, xm, K, out); break;
          default: row_dot<4>(wn, xm, K, out); break;
        }
        for (int64_t m = 0; m < mb; ++m) y[(m0 + m) * N + n] = kvflow::float_to_bf16(out[m] * s + b);
      }
    }
  }
};

}  // namespace

// x: [M, K] bf16, qweight: [N, K] int8, scales: [N] fp32, bias: optional [N] -> [M, N] bf16.
torch::Tensor skinny_linear_int8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && qweight.dtype() == torch::kInt8 && scales.dtype() == torch::kFloat32,
              "bf16 x, int8 weight and fp32 scales expected");
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1) && scales.numel() == qweight.size(0),
              "shape mismatch");
  x = x.contiguous();
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "contiguous weight and scales expected");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(torch::kFloat32).contiguous();
  const Gemv g{qweight.data_ptr<int8_t>(), scales.data_ptr<float>(),
               reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
               bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
               reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, N};
  // Grain: a thread streams >= ~64 KiB of weights between synchronisations.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / K);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { g.rows(begin, end); });
  return y;
}

// qweight: [N, K] int8, scales: [N] fp32 -> rows [n_begin, n_end) of q * s as bf16 [n_end - n_begin, K].
torch::Tensor dequantize_int8_rows(torch::Tensor qweight, torch::Tensor scales, int64_t n_begin, int64_t n_end) {
  TORCH_CHECK(qweight.dtype() == torch::kInt8 && scales.dtype() == torch::kFloat32, "int8 weight, fp32 scales");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "contiguous weight and scales expected");
  TORCH_CHECK(0 <= n_begin && n_begin <= n_end && n_end <= qweight.size(0), "row range out of bounds");
  const int64_t K = qweight.size(1), rows = n_end - n_begin;
  auto out = torch::empty({rows, K}, qweight.options().dtype(torch::kBFloat16));
  const int8_t* w = qweight.data_ptr<int8_t>() + n_begin * K;
  const float* s = scales.data_ptr<float>() + n_begin;
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const __m512 scale = _mm512_set1_ps(s[r]);
      for (int64_t k = 0; k < K; k += 16) {
        const int64_t left = K - k;
        const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + r * K + k)));
        // Round to nearest even exactly as torch's fp32 -> bf16 cast does.
        const __m256i packed = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(f, scale));
        _mm256_mask_storeu_epi16(o + r * K + k, mask, packed);
      }
    }
  });
  return out;
}
