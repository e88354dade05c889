// The decoder layer's element-wise steps on bf16 rows, one pass each, fp32 inside:
//   rms_norm_bf16:     y = bf16(x * rsqrt(mean(x^2) + eps) * w)
//   silu_and_mul_bf16: y = bf16(bf16(silu(gate)) * up)   over [gate | up] rows
//
// Why: through ATen, a bf16 RMSNorm of a few rows runs as a chain of small ops (casts, pow, mean,
// rsqrt, muls: 66 us a call on average in the offline benchmark, 8% of its op time together with
// the casts), and silu + mul as two passes with a bf16 temporary (benchmarks/NOTES.md).
// Numerics: RMSNorm rounds once at the end, as F.rms_norm does (kvflow/layers/norm.py: within one
// bf16 ulp of transformers' chain, which rounds the normalised x before the weight multiply); the
// mean of squares is summed in a different order than ATen's reduction. SiLU keeps ATen's bf16
// rounding of silu(gate) before the product; exp is a degree-6 polynomial (relative error < 2e-7,
// below bf16's 2^-9). kvflow/layers and decode_forward.cpp call these same functions, so the two
// decode paths stay bit-identical.

#include <ATen/Parallel.h>
#include "aten_lite.h"
#include "simd.h"

#include "bf16_utils.h"

#include <cmath>
#include <cstdint>

namespace {

using kvflow::exp_lanes;
using kvflow::lanes_left;
using kvflow::load_bf16_lanes;
using kvflow::store_bf16_lanes;
using kvflow::through_bf16_lanes;

constexpr int64_t kLanes = 16;
constexpr int64_t kGrainElements = 1 << 15;  // rows per thread chunk: ~32k elements (ATen's grain)

const uint16_t* bf16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bf16_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

}  // namespace

// x [R, H] bf16 (any row stride, unit inner stride), weight [H] bf16 -> [R, H] bf16.
at::Tensor rms_norm_bf16(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dtype() == at::kBFloat16 && weight.dtype() == at::kBFloat16, "bf16 x and weight expected");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.numel() == x.size(1), "x [R, H] with unit inner stride");
  weight = weight.contiguous();
  const int64_t R = x.size(0), H = x.size(1), stride = x.stride(0);
  auto y = kvflow::empty({R, H}, x.options());
  const uint16_t* xp = bf16(x);
  const uint16_t* wp = bf16(weight);
  uint16_t* yp = bf16_mut(y);
  at::parallel_for(0, R, std::max<int64_t>(1, kGrainElements / H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = xp + r * stride;
      __m512 sq = _mm512_setzero_ps();
      for (int64_t h = 0; h < H; h += kLanes) {
        const __m512 v = load_bf16_lanes(row + h, lanes_left(H - h));
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / float(H) + float(eps));
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int64_t h = 0; h < H; h += kLanes) {
        const __mmask16 m = lanes_left(H - h);
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(load_bf16_lanes(row + h, m), vinv), load_bf16_lanes(wp + h, m));
        store_bf16_lanes(yp + r * H + h, v, m);
      }
    }
  });
  return y;
}

// gate_up [R, 2I] bf16 ([gate | up] per row, unit inner stride) -> [R, I] bf16.
at::Tensor silu_and_mul_bf16(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dtype() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "bf16 [R, 2I] expected");
  const int64_t R = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto y = kvflow::empty({R, I}, gate_up.options());
  const uint16_t* gp = bf16(gate_up);
  uint16_t* yp = bf16_mut(y);
  at::parallel_for(0, R, std::max<int64_t>(1, kGrainElements / I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = gp + r * stride;
      for (int64_t i = 0; i < I; i += kLanes) {
        const __mmask16 m = lanes_left(I - i);
        const __m512 x = load_bf16_lanes(g + i, m);
        const __m512 silu = through_bf16_lanes(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        store_bf16_lanes(yp + r * I + i, _mm512_mul_ps(silu, load_bf16_lanes(g + I + i, m)), m);
      }
    }
  });
  return y;
}
