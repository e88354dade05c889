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

#include "gemv_common.h"

#include <cstdint>

namespace {

using namespace kvflow::gemv;

constexpr int64_t kPrefetchElems = 1024;  // 2 KiB ahead of the loads

struct Bf16Row {  // a bf16 weight row, read as it is stored
  const uint16_t* w;
  __m512bh chunk(int64_t k) const { return load_bf16(w + k); }
  __m512bh tail(int64_t k, int64_t left) const { return load_bf16(w + k, tail_mask(left)); }
  void prefetch(int64_t k) const {
    for (int64_t u = 0; u < kUnroll; ++u)  // one 64-byte line per 32 bf16
      _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetchElems + u * kLanes), _MM_HINT_T0);
  }
};

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
  const auto row_dot = [&](int64_t n, auto rows, int64_t m0, float* out) {
    dot_rows<decltype(rows)::value>(Bf16Row{wp + n * K}, xp + m0 * K, K, out);
  };
  const auto finish = [&](int64_t n, float dot) { return b ? dot + b[n] : dot; };
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) { gemv_rows(M, N, begin, end, row_dot, finish, yp); });
  return y;
}
