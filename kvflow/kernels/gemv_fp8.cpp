// Weight-only FP8 (e4m3) GEMV for decode: the checkpoint's bytes read as stored, widened in
// registers (kvflow/quant/fp8.py has the format).
//
// Weights: q[N, K] e4m3 bytes (row-major, as the checkpoint stores them), scale[N, KB] fp32, one per
// row and `block` inputs: W[n, k] = e4m3(q[n, k]) * scale[n, k / block].
// Widening, 16 weights at a time, by bit manipulation: e4m3 (s eeee mmm, bias 7) placed in fp16's
// fields (s eeeee mmmmmmmmmm, bias 15) as (b & 0x80) << 8 | (b & 0x7f) << 7 is the same number times
// 2^-8, subnormals included (fp16's are e4m3's shifted the same way), then vcvtph2ps to fp32; the
// 2^8 goes into the row's scale. No table: 5 integer ops and one conversion per 16 weights.
// (e4m3's NaN 0x7f / 0xff would widen to a finite value: checkpoints hold none.)
//
// skinny_linear_fp8: y[M, N] = x[M, K] @ W^T (+ bias), M <= 8 rows (decode), x bf16. Per row n and
// K block: fp32 products in 16 lanes, the block's lanes times its scale added into the row's lanes,
// one horizontal sum at the end (the tail of a block not a multiple of 16 in scalar). Several
// weight rows share a pass at few activation rows, for independent FMA chains. Threads split the rows.

#include <ATen/Parallel.h>
#include <torch/extension.h>
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxRows = 8;
constexpr float kFp16Rebias = 256.0f;  // 2^(15 - 7): the widened value is e4m3 * 2^-8

inline __m512 widen_e4m3(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
  return _mm512_cvtph_ps(_mm256_or_si256(sign, mag));
}

// One e4m3 byte as float (the tails of a block shorter than 16 inputs).
inline float e4m3_to_float(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 0x7;
  const float mag = exp == 0 ? std::ldexp(static_cast<float>(man) / 8.0f, -6)
                             : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

// Rows n .. n + R - 1 against all M activation rows: R x M independent accumulator chains per
// block (a single chain waits on each FMA's latency), each block's sums folded in by its scale as a
// vector FMA, one horizontal sum per row at the end.
template <int64_t R, int64_t M>
void rows_dot(const uint8_t* qs, const float* ss, const float* xs, int64_t n, int64_t K, int64_t KB, int64_t block,
              float* out /* [M, R] */) {
  __m512 total[R][M];
  float tail[R][M] = {};
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) total[r][m] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k0 = kb * block, k1 = std::min(K, k0 + block);
    __m512 acc[R][M];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + kLanes <= k1; k += kLanes) {
      __m512 x[M];
      for (int64_t m = 0; m < M; ++m) x[m] = _mm512_loadu_ps(xs + m * K + k);
      for (int64_t r = 0; r < R; ++r) {
        const __m512 w = widen_e4m3(qs + (n + r) * K + k);
        for (int64_t m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(w, x[m], acc[r][m]);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const float s = ss[(n + r) * KB + kb];
      const __m512 sv = _mm512_set1_ps(s * kFp16Rebias);
      for (int64_t m = 0; m < M; ++m) {
        total[r][m] = _mm512_fmadd_ps(acc[r][m], sv, total[r][m]);
        float dot = 0.0f;
        for (int64_t t = k; t < k1; ++t) dot += e4m3_to_float(qs[(n + r) * K + t]) * xs[m * K + t];
        tail[r][m] += dot * s;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) out[m * R + r] = _mm512_reduce_add_ps(total[r][m]) + tail[r][m];
}

template <int64_t M>
void gemv_rows(const uint8_t* qs, const float* ss, const float* xs, const float* bs, float* ys, int64_t n0, int64_t n1,
               int64_t N, int64_t K, int64_t KB, int64_t block) {
  // R x M <= 8 chains of 2 registers each: within the 32 zmm registers with the activations.
  constexpr int64_t R = M <= 2 ? 4 : M <= 4 ? 2 : 1;
  float out[M * R];
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    rows_dot<R, M>(qs, ss, xs, n, K, KB, block, out);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < R; ++r) ys[m * N + n + r] = out[m * R + r] + (bs != nullptr ? bs[n + r] : 0.0f);
  }
  for (; n < n1; ++n) {
    rows_dot<1, M>(qs, ss, xs, n, K, KB, block, out);
    for (int64_t m = 0; m < M; ++m) ys[m * N + n] = out[m] + (bs != nullptr ? bs[n] : 0.0f);
  }
}

}  // namespace

// x: [M, K] bf16; q: [N, K] uint8 (e4m3 bytes); scale: [N, KB] fp32 with KB = ceil(K / block);
// bias: optional [N] -> [M, N] bf16.
torch::Tensor skinny_linear_fp8(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t block,
                                c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.size(0) <= kMaxRows, "bf16 x [M <= 8, K] expected");
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.dim() == 2 && q.size(1) == x.size(1), "uint8 q [N, K] expected");
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  const int64_t KB = (K + block - 1) / block;
  TORCH_CHECK(block > 0 && scale.dtype() == torch::kFloat32 && scale.size(0) == N && scale.size(1) == KB,
              "fp32 scale [N, ceil(K / block)] expected");
  q = q.contiguous();
  scale = scale.contiguous();
  const torch::Tensor xf = x.to(torch::kFloat32).contiguous();
  torch::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(torch::kFloat32).contiguous();
  auto out = torch::empty({M, N}, torch::kFloat32);
  const float* xs = xf.data_ptr<float>();
  const uint8_t* qs = q.data_ptr<uint8_t>();
  const float* ss = scale.data_ptr<float>();
  const float* bs = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  float* ys = out.data_ptr<float>();
  // Grain: a thread streams >= ~64 KiB of weights between synchronisations.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: gemv_rows<1>(qs, ss, xs, bs, ys, n0, n1, N, K, KB, block); break;
      case 2: gemv_rows<2>(qs, ss, xs, bs, ys, n0, n1, N, K, KB, block); break;
      case 3: gemv_rows<3>(qs, ss, xs, bs, ys, n0, n1, N, K, KB, block); break;
      case 4: gemv_rows<4>(qs, ss, xs, bs, ys, n0, n1, N, K, KB, block); break;
      case 5: gemv_rows<5>(qs, ss, xs, bs, ys, n0, n1, N, K, KB, block); break;
      case 6: gemv_rows<6>(qs, ss, xs, bs, ys, n0, n1, N, K, KB, block); break;
      case 7: gemv_rows<7>(qs, ss, xs, bs, ys, n0, n1, N, K, KB, block); break;
      default: gemv_rows<8>(qs, ss, xs, bs, ys, n0, n1, N, K, KB, block); break;
    }
  });
  return out.to(torch::kBFloat16);
}
