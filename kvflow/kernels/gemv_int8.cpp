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

#include "gemv_common.h"

#include <algorithm>
#include <cstdint>

namespace {

using namespace kvflow::gemv;

constexpr int64_t kPrefetchBytes = 4096;  // int8 weights prefetched ahead of the loads

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

struct Int8Row {  // an int8 weight row, widened exactly to bf16 as it is read
  const int8_t* w;
  __m512bh chunk(int64_t k) const {
    const __m128i* p = reinterpret_cast<const __m128i*>(w + k);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
  __m512bh tail(int64_t k, int64_t left) const { return widen_int8_to_bf16(w + k, left); }
  void prefetch(int64_t k) const {
    for (int64_t line = 0; line < kLanes * kUnroll; line += 64)  // one prefetch per 64-byte line
      _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetchBytes + line), _MM_HINT_T0);
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
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto row_dot = [&](int64_t n, auto rows, int64_t m0, float* out) {
    dot_rows<decltype(rows)::value>(Int8Row{wp + n * K}, xp + m0 * K, K, out);
  };
  const auto finish = [&](int64_t n, float dot) { return dot * sp[n] + (b ? b[n] : 0.0f); };
  // Grain: a thread streams >= ~64 KiB of weights between synchronisations.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / K);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { gemv_rows(M, N, begin, end, row_dot, finish, yp); });
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
