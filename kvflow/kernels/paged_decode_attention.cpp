// Decode attention read straight from the paged KV pool (bf16), one work item per (sequence, KV head).
//
// Why: the generic path gathers every sequence's keys and values into a padded [B, Hkv, L, D]
// copy (index_select) and runs SDPA, whose CPU flash kernel is inefficient for a handful of query
// rows per KV head (measured at batch 64, context ~500: 3.4 ms per layer for ~10 MB of KV). Here
// each (b, h) reads its keys and values once, in place, through the slot list.
//
// For sequence b, KV head h, the G = Hq / Hkv query heads sharing it (GQA without repeating K/V):
//   s[g, l] = scale * <q[b, h*G + g], K[slot(b, l), h]>          l < seq_len[b]
//   p[g, l] = exp(s[g, l] - max_l s[g, :]) / sum_l exp(...)       (two-pass softmax, fp32)
//   out[b, h*G + g] = sum_l p[g, l] * V[slot(b, l), h]
// All arithmetic is fp32; inputs and output are bf16 (the output rounded to nearest even).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "bf16_utils.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // fp32 lanes per 512-bit register

inline __mmask16 tail_mask(int64_t left) {
  return left >= kLanes ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
}

// 16 bf16 -> 16 fp32: bf16 is the top half of an fp32, so widen and shift.
inline __m512 load_bf16_as_f32(const uint16_t* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (softmax after max subtraction): 2^(x log2 e) split into 2^n * 2^f, f in
// [-0.5, 0.5], 2^f by its degree-6 Taylor polynomial (relative error < 2e-7 there).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // exp(-87) ~ 1.6e-38: below, the weight is 0 anyway
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);                 // ln2^6 / 720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Softmax of s[0..L) in place; returns 1 / sum so the caller can normalise the output once.
inline float softmax_unnormalised(float* s, int64_t L) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < L; l += kLanes)
    vmax = _mm512_mask_max_ps(vmax, tail_mask(L - l), vmax, _mm512_maskz_loadu_ps(tail_mask(L - l), s + l));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; l += kLanes) {
    const __mmask16 mask = tail_mask(L - l);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + l), m));
    _mm512_mask_storeu_ps(s + l, mask, e);
    vsum = _mm512_mask_add_ps(vsum, mask, vsum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

struct Problem {
  const uint16_t* q;       // [B, Hq, D]
  const uint16_t* k;       // [S, Hkv, D]
  const uint16_t* v;       // [S, Hkv, D]
  const int64_t* slots;    // [B, Lmax]
  const int64_t* seq_lens; // [B]
  uint16_t* out;           // [B, Hq, D]
  int64_t Hq, Hkv, D, Lmax;
  float scale;
};

constexpr int64_t kMaxChunks = 16;  // head_dim up to 256 (16 x 16 lanes) keeps a K row in registers
constexpr int64_t kHeadGroup = 8;   // query heads accumulated together in the P.V pass (8 registers)

// scores[g * L + l] = <qf[g], K[l]> for every key l; each key row is widened to fp32 once and
// reused by all G query heads.
void compute_scores(const Problem& P, const int64_t* slots, int64_t h, int64_t G, int64_t L, const float* qf,
                    float* scores) {
  const int64_t D = P.D, chunks = (D + kLanes - 1) / kLanes;
  __m512 krow[kMaxChunks];
  for (int64_t l = 0; l < L; ++l) {
    const uint16_t* kp = P.k + (slots[l] * P.Hkv + h) * D;
    for (int64_t c = 0; c < chunks; ++c) krow[c] = load_bf16_as_f32(kp + c * kLanes, tail_mask(D - c * kLanes));
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * chunks * kLanes;  // zero-padded to whole chunks
      __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), krow[0]);
      for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c * kLanes), krow[c], dot);
      scores[g * L + l] = _mm512_reduce_add_ps(dot);
    }
  }
}

// acc[g * chunks * 16 + ...] = sum_l p[g, l] V[l]: per 16-wide slice of the head dimension and
// group of up to kHeadGroup heads, the accumulators stay in registers across all L values.
void accumulate_values(const Problem& P, const int64_t* slots, int64_t h, int64_t G, int64_t L,
                       const float* probs, float* acc) {
  const int64_t D = P.D, chunks = (D + kLanes - 1) / kLanes;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 mask = tail_mask(D - c * kLanes);
    for (int64_t g0 = 0; g0 < G; g0 += kHeadGroup) {
      const int64_t gn = std::min(kHeadGroup, G - g0);
      __m512 a[kHeadGroup];
      for (int64_t j = 0; j < gn; ++j) a[j] = _mm512_setzero_ps();
      for (int64_t l = 0; l < L; ++l) {
        const __m512 vv = load_bf16_as_f32(P.v + (slots[l] * P.Hkv + h) * D + c * kLanes, mask);
        for (int64_t j = 0; j < gn; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(probs[(g0 + j) * L + l]), vv, a[j]);
      }
      for (int64_t j = 0; j < gn; ++j) _mm512_storeu_ps(acc + ((g0 + j) * chunks + c) * kLanes, a[j]);
    }
  }
}

// One (sequence b, KV head h); `scratch` is the calling thread's buffer.
void attend_one(const Problem& P, int64_t b, int64_t h, std::vector<float>& scratch) {
  const int64_t G = P.Hq / P.Hkv, D = P.D, L = P.seq_lens[b], chunks = (D + kLanes - 1) / kLanes;
  const int64_t padded = chunks * kLanes;
  const int64_t* slots = P.slots + b * P.Lmax;
  scratch.assign(G * L + 2 * G * padded, 0.0f);
  float* scores = scratch.data();
  float* qf = scores + G * L;  // [G, padded]: q widened to fp32, pre-scaled, zero tail
  float* acc = qf + G * padded;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t bits = uint32_t(P.q[(b * P.Hq + h * G + g) * D + d]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      qf[g * padded + d] = f * P.scale;
    }
  compute_scores(P, slots, h, G, L, qf, scores);
  float inv_sum[64];
  for (int64_t g = 0; g < G; ++g) inv_sum[g] = softmax_unnormalised(scores + g * L, L);
  accumulate_values(P, slots, h, G, L, scores, acc);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d)
      P.out[(b * P.Hq + h * G + g) * D + d] = kvflow::float_to_bf16(acc[g * padded + d] * inv_sum[g]);
}

}  // namespace

torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                          torch::Tensor slots, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kBFloat16 && key_cache.dtype() == torch::kBFloat16 &&
                  value_cache.dtype() == torch::kBFloat16, "bf16 q/k/v expected");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && seq_lens.dtype() == torch::kInt64, "int64 slots/seq_lens expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV pools must be contiguous");
  q = q.contiguous();
  slots = slots.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = key_cache.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && key_cache.size(2) == D && slots.size(0) == B && seq_lens.size(0) == B, "shapes");
  TORCH_CHECK(D <= kMaxChunks * kLanes && Hq / Hkv <= 64, "head_dim <= 256 and <= 64 query heads per KV head");
  auto out = torch::empty_like(q);
  Problem P{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>()),
            slots.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
            reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
            Hq, Hkv, D, slots.size(1), static_cast<float>(scale)};
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) attend_one(P, i / Hkv, i % Hkv, scratch);
  });
  return out;
}
