// Greedy sampling's argmax over the vocabulary, one row per sequence: logits [R, V] fp32 or bf16 ->
// [R] int64, the first index of each row's maximum, as torch.argmax gives (a NaN counts as the
// maximum: the first NaN's index). bf16 rows are widened exactly as they are read, so their argmax
// is that of their fp32 copy: greedy rows need not materialise one (a [64, 151936] copy is ~1 ms).
//
// Why: torch.argmax on CPU scans a [8, 151936] fp32 row block at ~3.5 GB/s (342 us; 85 us for
// one row), ~1.4% of an 8-sequence decode step of the Qwen2.5-0.5B shape (benchmarks/NOTES.md).
// Here: one vectorised pass for the maximum, one for its first position, rows over the threads.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16_utils.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr int64_t kLanes = 16;

// 16 elements from x + v (masked) as fp32: plain loads, or bf16 widened (bf16 is the top half of an fp32).
inline __m512 load16(const float* x, int64_t v, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x + v); }
inline __m512 load16(const at::BFloat16* x, int64_t v, __mmask16 m) {
  return kvflow::load_bf16_lanes(reinterpret_cast<const uint16_t*>(x) + v, m);
}

template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t v = 0; v < V; v += kLanes) {
    const __mmask16 m = kvflow::lanes_left(V - v);
    const __m512 xv = load16(x, v, m);
    nan |= _mm512_mask_cmp_ps_mask(m, xv, xv, _CMP_UNORD_Q);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, xv);
  }
  if (nan) {  // torch: a NaN is the maximum
    for (int64_t v = 0; v < V; ++v)
      if (std::isnan(static_cast<float>(x[v]))) return v;
  }
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  for (int64_t v = 0; v < V; v += kLanes) {
    const __mmask16 m = kvflow::lanes_left(V - v);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, load16(x, v, m), best, _CMP_EQ_OQ);
    if (hit) return v + __builtin_ctz(static_cast<unsigned>(hit));
  }
  return 0;  // unreachable: the maximum is one of the values
}

template <typename T>
void argmax_all(const T* x, int64_t R, int64_t V, int64_t* o) {
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * V, V);
  });
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK((logits.dtype() == torch::kFloat32 || logits.dtype() == torch::kBFloat16) && logits.dim() == 2 &&
                  logits.size(1) > 0,
              "fp32 or bf16 [R, V] logits");
  logits = logits.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  auto out = torch::empty({R}, logits.options().dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  if (logits.dtype() == torch::kFloat32) argmax_all(logits.data_ptr<float>(), R, V, o);
  else argmax_all(logits.data_ptr<at::BFloat16>(), R, V, o);
  return out;
}
