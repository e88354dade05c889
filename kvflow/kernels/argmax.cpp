// Greedy sampling's argmax over the vocabulary, one row per sequence: logits [R, V] fp32 or bf16 ->
// [R] int64, the first index of each row's maximum, as torch.argmax gives (a NaN counts as the
// maximum: the first NaN's index). bf16 rows are widened exactly as they are read, so their argmax
// is that of their fp32 copy: greedy rows need not materialise one (a [64, 151936] copy is ~1 ms).
//
// Why: torch.argmax on CPU scans a [8, 151936] fp32 row block at ~3.5 GB/s (342 us; 85 us for
// one row), ~1.4% of an 8-sequence decode step of the Qwen2.5-0.5B shape (benchmarks/NOTES.md).
// Here: one vectorised pass per span that keeps each lane's maximum and the first index reaching
// it (argmax_lanes.h). Every row is split into one column span per thread, so a lone row
// (single-stream decode) uses both threads; the spans combine in column order. Greedy decode
// through a native LM head does not come here: the head's GEMV folds the argmax into its tiles.

#include <ATen/Parallel.h>
#include "aten_lite.h"
#include "simd.h"

#include "argmax_lanes.h"
#include "bf16_utils.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// 16 elements from x + v (masked) as fp32: plain loads, or bf16 widened (bf16 is the top half of an fp32).
inline __m512 load16(const float* x, int64_t v, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x + v); }
inline __m512 load16(const at::BFloat16* x, int64_t v, __mmask16 m) {
  return kvflow::load_bf16_lanes(reinterpret_cast<const uint16_t*>(x) + v, m);
}

template <typename T>
kvflow::SpanBest argmax_span(const T* x, int64_t begin, int64_t end) {
  kvflow::LaneBest lanes;
  for (int64_t v = begin; v < end; v += kLanes) {
    const __mmask16 m = kvflow::lanes_left(end - v);
    lanes.update(load16(x, v, m), v, m);
  }
  return lanes.result(begin, end, [&](int64_t v) { return static_cast<float>(x[v]); });
}

template <typename T>
void argmax_all(const T* x, int64_t R, int64_t V, int64_t* o) {
  const int64_t spans = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), V / kLanes));
  std::vector<kvflow::SpanBest> best(R * spans);
  // Thread t takes span t of every row (one work item per span, so the split is by columns).
  at::parallel_for(0, spans, 1, [&](int64_t s_begin, int64_t s_end) {
    for (int64_t s = s_begin; s < s_end; ++s) {
      const int64_t begin = V * s / spans / kLanes * kLanes;
      const int64_t end = s + 1 == spans ? V : V * (s + 1) / spans / kLanes * kLanes;
      for (int64_t r = 0; r < R; ++r) best[r * spans + s] = argmax_span(x + r * V, begin, end);
    }
  });
  for (int64_t r = 0; r < R; ++r) {
    kvflow::SpanBest b = best[r * spans];
    for (int64_t s = 1; s < spans; ++s) b = kvflow::combine(b, best[r * spans + s]);
    o[r] = b.index;
  }
}

}  // namespace

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK((logits.dtype() == at::kFloat || logits.dtype() == at::kBFloat16) && logits.dim() == 2 &&
                  logits.size(1) > 0,
              "fp32 or bf16 [R, V] logits");
  logits = logits.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  auto out = kvflow::empty({R}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (logits.dtype() == at::kFloat) argmax_all(logits.data_ptr<float>(), R, V, o);
  else argmax_all(logits.data_ptr<at::BFloat16>(), R, V, o);
  return out;
}
