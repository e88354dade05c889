// Skinny bf16 matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small (<= ~16).
//
// Why: decode reads every weight once per step, so it is bound by memory bandwidth. On the
// 2-core AVX512-BF16 EPYC this project is measured on, oneDNN's M=1 path streams weights at
// ~26 GB/s whatever the machine's bandwidth (40-74 GB/s); this kernel reads W row-block by
// row-block with AVX512-BF16 dot products (vdpbf16ps: 32 bf16 products per instruction, fp32
// accumulation) and keeps up with the memory system (benchmarks/NOTES.md).
//
// Layout: W is the Hugging Face [out_features, in_features] row-major bf16 matrix, untouched.
// Work split: threads take contiguous ranges of output rows; each row is streamed once and dotted
// with every row of x (x stays in L1: M * K * 2 bytes).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16_utils.h"

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kMaxM = 4;   // activation rows per pass (4 x kUnroll accumulators); more loop
constexpr int64_t kLanes = 32; // bf16 elements per 512-bit register

inline __m512bh load_bf16(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// One output row (W row `w`, K elements) against `MB` activation rows: out[m] = dot(w, x[m]).
// The row is read front to back, so a thread's whole share of W is one sequential stream (the
// hardware prefetcher follows one stream far better than several interleaved ones: measured 2x),
// with kUnroll independent accumulators per x row to hide the dot-product latency, and an
// explicit prefetch kPrefetchElems ahead (it runs into the next row, which is contiguous).
constexpr int64_t kUnroll = 4;
constexpr int64_t kPrefetchElems = 1024;  // 2 KiB ahead of the loads

template <int64_t MB>
inline void row_dot(const uint16_t* w, const uint16_t* x, int64_t K, float* out) {
  __m512 acc[MB][kUnroll];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t u = 0; u < kUnroll; ++u) acc[m][u] = _mm512_setzero_ps();
  const __mmask32 all = ~__mmask32(0);
  int64_t k = 0;
  for (; k + kLanes * kUnroll <= K; k += kLanes * kUnroll) {
    for (int64_t u = 0; u < kUnroll; ++u)  // one 64-byte line per 32 bf16
      _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetchElems + u * kLanes), _MM_HINT_T0);
    for (int64_t u = 0; u < kUnroll; ++u) {
      const __m512bh wv = load_bf16(w + k + u * kLanes, all);
      for (int64_t m = 0; m < MB; ++m)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, load_bf16(x + m * K + k + u * kLanes, all));
    }
  }
  for (; k < K; k += kLanes) {  // tail: whole or partial 32-element chunks
    const int64_t left = K - k;
    const __mmask32 mask = left >= kLanes ? all : (__mmask32(1) << left) - 1;
    const __m512bh wv = load_bf16(w + k, mask);
    for (int64_t m = 0; m < MB; ++m) acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, load_bf16(x + m * K + k, mask));
  }
  for (int64_t m = 0; m < MB; ++m) {
    __m512 total = acc[m][0];
    for (int64_t u = 1; u < kUnroll; ++u) total = _mm512_add_ps(total, acc[m][u]);
    out[m] = _mm512_reduce_add_ps(total);
  }
}

// Rows [n_begin, n_end) of y = x @ W^T (+ bias), for every activation row, in groups of kMaxM.
inline void rows_times_x(const uint16_t* w, const uint16_t* x, int64_t M, int64_t K, int64_t N, int64_t n_begin,
                         int64_t n_end, const float* bias, uint16_t* y) {
  float out[kMaxM];
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint16_t* wn = w + n * K;
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
      const int64_t mb = std::min(kMaxM, M - m0);
      const uint16_t* xm = x + m0 * K;
      switch (mb) {
        case 1: row_dot<1>(wn, xm, K, out); break;
        case 2: row_dot<2>(wn, xm, K, out); break;
        case 3: row_dot<3>(wn, xm, K, out); break;
        default: row_dot<4>(wn, xm, K, out); break;
      }
      for (int64_t m = 0; m < mb; ++m) y[(m0 + m) * N + n] = kvflow::float_to_bf16(out[m] + b);
    }
  }
}

}  // namespace

// x: [M, K] bf16, w: [N, K] bf16, bias: optional [N] (any float dtype) -> [M, N] bf16.
torch::Tensor skinny_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && w.dtype() == torch::kBFloat16, "bf16 inputs expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(torch::kFloat32).contiguous();
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // Grain: enough rows per task that a thread streams >= ~64 KiB of weights between syncs.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K * 2));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { rows_times_x(wp, xp, M, K, N, begin, end, b, yp); });
  return y;
}
