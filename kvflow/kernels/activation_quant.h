// Activations quantized to int8 per block of 32 inputs for the VNNI GEMVs (gemv_int8.cpp,
// gemv_int4.cpp), as llama.cpp's q8_0 does: symmetric, dx_b = max|x_b| / 127, q = round(x / dx_b)
// half to even (|q| <= 127). One pass per GEMV call, before the weights are streamed.
// Note: torch's JIT builder hashes the .cpp sources, not headers (kvflow's build cache hashes both).
#pragma once

#include <ATen/Parallel.h>
#include "simd.h"

#include "bf16_utils.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kvflow {

constexpr int64_t kActivationBlock = 32;  // inputs per activation scale (llama.cpp's q8_0 block)
constexpr float kActivationInt8Max = 127.0f;
// Rows per task when a prefill chunk's activations are quantized on every thread; a decode batch
// (<= 8 rows) stays on the calling thread.
constexpr int64_t kQuantizeGrainRows = 16;

struct Int8Activations {
  std::vector<int8_t> q;      // [M, K_pad]: round(x / dx_b); inputs past K (padding) are 0
  std::vector<float> scales;  // [M, K_pad / 32]: dx_b
  std::vector<int32_t> sums;  // [M, K_pad / 32]: sum of the block's q (for unsigned-weight offsets)
  int64_t padded_k = 0;       // K rounded up to a whole block
};

// x [M, K] bf16 (row stride K) -> its int8 blocks, K zero-padded to a multiple of 32. Vectorised
// (16 lanes; _mm512_cvtps_epi32 rounds half to even under the default rounding mode, as nearbyint
// does): at K = 4864 the scalar loop took about half of an 8-row down_proj GEMV on one thread.
inline Int8Activations quantize_activations_int8(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t blocks = (K + kActivationBlock - 1) / kActivationBlock, padded = blocks * kActivationBlock;
  Int8Activations a{std::vector<int8_t>(M * padded, 0), std::vector<float>(M * blocks), std::vector<int32_t>(M * blocks),
                    padded};
  at::parallel_for(0, M, kQuantizeGrainRows, [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k0 = b * kActivationBlock;
        const __mmask16 m0 = lanes_left(K - k0), m1 = K - k0 > 16 ? lanes_left(K - k0 - 16) : __mmask16(0);
        const __m512 x0 = load_bf16_lanes(x + m * K + k0, m0);
        const __m512 x1 = K - k0 > 16 ? load_bf16_lanes(x + m * K + k0 + 16, m1) : _mm512_setzero_ps();
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? kActivationInt8Max / amax : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
        int8_t* out = a.q.data() + m * padded + k0;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(q1));
        a.scales[m * blocks + b] = amax / kActivationInt8Max;
        a.sums[m * blocks + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      }
    }
  });
  return a;
}

}  // namespace kvflow
