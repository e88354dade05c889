// Decode attention read straight from the paged KV pool, one work item per (sequence, KV head), or
// per (run of rows sharing one slot list, KV head) for bf16 pools (row_groups).
// Pools: bf16, or quantized per token and KV head (kvflow/attention/kv_layer.py): int8 and fp8_e4m3
// with one fp16 scale, int4 (two per byte, element 2i in the low nibble) with fp16 scale and zero.
//
// Why: the generic path gathers every sequence's keys and values into a padded [B, Hkv, L, D]
// copy (index_select) and runs SDPA, whose CPU flash kernel is inefficient for a handful of query
// rows per KV head (measured at batch 64, context ~500: 3.4 ms per layer for ~10 MB of KV). Here
// each (b, h) reads its keys and values once, in place, through the slot list.
//
// For sequence b, KV head h, the G = Hq / Hkv query heads sharing it (GQA without repeating K/V):
//   s[g, l] = scale * <q[b, h*G + g], K[slot(b, l), h]>          l < seq_len[b]
//   p[g, l] = exp(s[g, l] - m[g]) / (sum_l exp(s[g, l] - m[g]) + exp(sink[h*G + g] - m[g]))
//             m[g] = max(max_l s[g, :], sink[h*G + g])            (two-pass softmax, fp32)
//   out[b, h*G + g] = sum_l p[g, l] * V[slot(b, l), h]
// The sink logits (gpt-oss; attention_sinks.h) are optional: without them (-inf) the softmax is
// the plain one, bit for bit.
// All arithmetic is fp32; q and the output are bf16 (the output rounded to nearest even). A
// quantized key or value row is dequantized in registers as it is read (x = q * s [+ z]), so the
// kernel streams the pool's 1 or 0.5 bytes per element instead of gathering a dequantized copy.

#include <ATen/Parallel.h>
#include "aten_lite.h"
#include "simd.h"

#include "attention_simd.h"
#include "attention_sinks.h"
#include "bf16_utils.h"
#include "row_dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using kvflow::exp_lanes;
using kvflow::kNoSink;
using kvflow::lanes_left;
using kvflow::load_bf16_lanes;
using kvflow::sink_of;
using kvflow::transpose16;

constexpr int64_t kLanes = 16;  // fp32 lanes per 512-bit register

// Softmax of s[0..L) in place, its denominator including exp(sink - max) (kNoSink: none, and then
// the same bits as without); returns 1 / sum so the caller can normalise the output once.
inline float softmax_unnormalised(float* s, int64_t L, float sink) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < L; l += kLanes)
    vmax = _mm512_mask_max_ps(vmax, lanes_left(L - l), vmax, _mm512_maskz_loadu_ps(lanes_left(L - l), s + l));
  const float peak = std::max(_mm512_reduce_max_ps(vmax), sink);
  const __m512 m = _mm512_set1_ps(peak);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; l += kLanes) {
    const __mmask16 mask = lanes_left(L - l);
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + l), m));
    _mm512_mask_storeu_ps(s + l, mask, e);
    vsum = _mm512_mask_add_ps(vsum, mask, vsum, e);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
  return 1.0f / (sink == kNoSink ? sum : sum + std::exp(sink - peak));
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// The pool rows a sequence attends are scattered over its blocks and every row is read once per
// step from DRAM, so without help the kernel waits on each row in turn (measured: 4 GB/s of KV at
// 8 x 551 keys, a third of a decode step): rows kPrefetchKeys keys ahead are requested early.
constexpr int64_t kPrefetchKeys = 8;
constexpr int64_t kCacheLine = 64;
template <int Hint = _MM_HINT_T0>
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += kCacheLine) _mm_prefetch(p + off, static_cast<_mm_hint>(Hint));
}

// Row readers: elements [16c, 16c + 16) of the (slot, head) row as fp32, `mask` covering the valid
// ones. One per pool format; the kernel below is written once against them.
struct Bf16Rows {  // data [S, Hkv, D] bf16
  const uint16_t* data;
  int64_t Hkv, D;
  inline __m512 load(int64_t slot, int64_t h, int64_t c, __mmask16 mask) const {
    return load_bf16_lanes(data + (slot * Hkv + h) * D + c * kLanes, mask);
  }
  inline void prefetch(int64_t slot, int64_t h) const { prefetch_row(data + (slot * Hkv + h) * D, 2 * D); }
};

struct Int8Rows {  // data [S, Hkv, D] int8, scale [S, Hkv] fp16: x = q * s
  const int8_t* data;
  const uint16_t* scale;
  int64_t Hkv, D;
  inline __m512 load(int64_t slot, int64_t h, int64_t c, __mmask16 mask) const {
    const int64_t row = slot * Hkv + h;
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, data + row * D + c * kLanes)));
    return _mm512_mul_ps(q, _mm512_set1_ps(half_to_float(scale[row])));
  }
  inline void prefetch(int64_t slot, int64_t h) const { prefetch_row(data + (slot * Hkv + h) * D, D); }
};

// fp8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits) -> fp16 bits: the same fields
// moved to fp16's positions (exponent biased by 15, so the value is 2^-8 of the fp8 one, subnormals
// included), widened exactly by vcvtph2ps; the 2^8 is folded into the row scale.
constexpr float kFp8ToFp16Rebias = 256.0f;
struct Fp8Rows {  // data [S, Hkv, D] e4m3 bytes, scale [S, Hkv] fp16: x = fp8(q) * s
  const uint8_t* data;
  const uint16_t* scale;
  int64_t Hkv, D;
  inline __m512 load(int64_t slot, int64_t h, int64_t c, __mmask16 mask) const {
    const int64_t row = slot * Hkv + h;
    const __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask, data + row * D + c * kLanes));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
    const __m512 f = _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
    return _mm512_mul_ps(f, _mm512_set1_ps(half_to_float(scale[row]) * kFp8ToFp16Rebias));
  }
  inline void prefetch(int64_t slot, int64_t h) const { prefetch_row(data + (slot * Hkv + h) * D, D); }
};

struct Int4Rows {  // data [S, Hkv, D / 2] two per byte, scale and zero [S, Hkv] fp16: x = q * s + z
  const uint8_t* data;
  const uint16_t* scale;
  const uint16_t* zero;
  int64_t Hkv, D;
  inline __m512 load(int64_t slot, int64_t h, int64_t c, __mmask16 mask) const {
    const int64_t row = slot * Hkv + h;
    // 16 elements = 8 bytes; `mask` has one bit per element, the load one per byte (D is even).
    const __mmask16 byte_mask = __mmask16(_pext_u32(mask, 0x5555u));
    const __m128i packed = _mm_cvtepu8_epi16(_mm_maskz_loadu_epi8(byte_mask, data + row * (D / 2) + c * (kLanes / 2)));
    // u16 lane i holds byte i: low nibble (element 2i) stays in its low byte, the high nibble
    // (element 2i + 1) moves to the high byte, so the 16 bytes are the elements in order.
    const __m128i lo = _mm_and_si128(packed, _mm_set1_epi16(0x0f));
    const __m128i hi = _mm_slli_epi16(_mm_srli_epi16(packed, 4), 8);
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_or_si128(lo, hi)));
    return _mm512_fmadd_ps(q, _mm512_set1_ps(half_to_float(scale[row])), _mm512_set1_ps(half_to_float(zero[row])));
  }
  inline void prefetch(int64_t slot, int64_t h) const { prefetch_row(data + (slot * Hkv + h) * (D / 2), D / 2); }
};

template <typename Rows>
struct Problem {
  const uint16_t* q;       // [B, Hq, D]
  Rows k;                  // [S, Hkv, D] (as the format stores it)
  Rows v;
  const int64_t* slots;    // [B, L] with row stride slot_stride (0: every row reads the same keys)
  const int64_t* seq_lens; // [B]
  uint16_t* out;           // [B, Hq, D]
  int64_t Hq, Hkv, D, slot_stride;
  float scale;
  const float* sinks;      // [Hq] sink logits, or nullptr: none
};

constexpr int64_t kMaxChunks = 16;  // head_dim up to 256 (16 x 16 lanes) keeps a K row in registers
constexpr int64_t kHeadGroup = 8;   // query heads accumulated together in the P.V pass (8 registers)

constexpr int64_t kKeyBlock = 16;  // keys whose scores are reduced together (one per fp32 lane)

// out lane i = the sum of v[i]'s 16 lanes, for 16 vectors: four rounds of folding pairs
// (v[2i], v[2i + 1]) into one vector holding both halves' pairwise sums (even + odd lanes of their
// concatenation), so lane order follows i. 45 instructions for 16 sums, against ~8 each for
// _mm512_reduce_add_ps, with independent chains instead of one long one.
inline __m512 reduce16(__m512* v) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t n = kKeyBlock; n > 1; n /= 2)
    for (int64_t i = 0; i < n / 2; ++i)
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], even, v[2 * i + 1]),
                           _mm512_permutex2var_ps(v[2 * i], odd, v[2 * i + 1]));
  return v[0];
}

// scores[g * L + l] = <qf[g], K[l]> for every key l, 16 keys at a time: each key row is widened to
// fp32 once and dotted with all G query heads into a 16-lane partial (partials[g * 16 + j]), and
// the 16 keys' partials of a head are summed across lanes together (reduce16).
template <typename Rows>
void compute_scores(const Problem<Rows>& P, const int64_t* slots, int64_t h, int64_t G, int64_t L, const float* qf,
                    float* scores, float* partials) {
  const int64_t D = P.D, chunks = (D + kLanes - 1) / kLanes;
  __m512 krow[kMaxChunks];
  for (int64_t l0 = 0; l0 < L; l0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, L - l0);
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      if (j >= nk) {  // past the last key: zeros (their lanes are not stored)
        for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(partials + (g * kKeyBlock + j) * kLanes, _mm512_setzero_ps());
        continue;
      }
      if (l0 + j + kPrefetchKeys < L) P.k.prefetch(slots[l0 + j + kPrefetchKeys], h);
      for (int64_t c = 0; c < chunks; ++c) krow[c] = P.k.load(slots[l0 + j], h, c, lanes_left(D - c * kLanes));
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * chunks * kLanes;  // zero-padded to whole chunks
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), krow[0]);
        for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c * kLanes), krow[c], dot);
        _mm512_storeu_ps(partials + (g * kKeyBlock + j) * kLanes, dot);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      __m512 v[kKeyBlock];
      for (int64_t j = 0; j < kKeyBlock; ++j) v[j] = _mm512_loadu_ps(partials + (g * kKeyBlock + j) * kLanes);
      _mm512_mask_storeu_ps(scores + g * L + l0, lanes_left(nk), reduce16(v));
    }
  }
}

// acc[g * chunks * 16 + ...] = sum_l p[g, l] V[l]: per 16-wide slice of the head dimension and
// group of up to kHeadGroup heads, the accumulators stay in registers across all L values.
template <typename Rows>
void accumulate_values(const Problem<Rows>& P, const int64_t* slots, int64_t h, int64_t G, int64_t L,
                       const float* probs, float* acc) {
  const int64_t D = P.D, chunks = (D + kLanes - 1) / kLanes;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 mask = lanes_left(D - c * kLanes);
    for (int64_t g0 = 0; g0 < G; g0 += kHeadGroup) {
      const int64_t gn = std::min(kHeadGroup, G - g0);
      __m512 a[kHeadGroup];
      for (int64_t j = 0; j < gn; ++j) a[j] = _mm512_setzero_ps();
      for (int64_t l = 0; l < L; ++l) {
        if (c == 0 && g0 == 0 && l + kPrefetchKeys < L) P.v.prefetch(slots[l + kPrefetchKeys], h);
        const __m512 vv = P.v.load(slots[l], h, c, mask);
        for (int64_t j = 0; j < gn; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(probs[(g0 + j) * L + l]), vv, a[j]);
      }
      for (int64_t j = 0; j < gn; ++j) _mm512_storeu_ps(acc + ((g0 + j) * chunks + c) * kLanes, a[j]);
    }
  }
}

// One (sequence b, KV head h); `scratch` is the calling thread's buffer.
template <typename Rows>
void attend_one(const Problem<Rows>& P, int64_t b, int64_t h, std::vector<float>& scratch) {
  const int64_t G = P.Hq / P.Hkv, D = P.D, L = P.seq_lens[b], chunks = (D + kLanes - 1) / kLanes;
  const int64_t padded = chunks * kLanes;
  const int64_t* slots = P.slots + b * P.slot_stride;
  scratch.assign(G * L + 2 * G * padded + G * kKeyBlock * kLanes, 0.0f);
  float* scores = scratch.data();
  float* qf = scores + G * L;  // [G, padded]: q widened to fp32, pre-scaled, zero tail
  float* acc = qf + G * padded;
  float* partials = acc + G * padded;  // [G, 16 keys, 16 lanes]
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t bits = uint32_t(P.q[(b * P.Hq + h * G + g) * D + d]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      qf[g * padded + d] = f * P.scale;
    }
  compute_scores(P, slots, h, G, L, qf, scores, partials);
  float inv_sum[64];
  for (int64_t g = 0; g < G; ++g) inv_sum[g] = softmax_unnormalised(scores + g * L, L, sink_of(P.sinks, h * G + g));
  accumulate_values(P, slots, h, G, L, scores, acc);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d)
      P.out[(b * P.Hq + h * G + g) * D + d] = kvflow::float_to_bf16(acc[g * padded + d] * inv_sum[g]);
}

// ---- bf16 pools: keys along the lanes -----------------------------------------------------------
// The row-reader path above costs ~190 cycles per key and KV head at GQA 7:1, D = 64 (8 sequences
// x 543 keys: 5.6 ms of a 31 ms decode step; benchmarks/NOTES.md): every key's 7 dot products end
// in a horizontal sum, and every key is widened to fp32 before its dot products and again, per
// 16-dim chunk, in the P.V pass. For bf16 pools two changes remove most of that work:
//   Q.K   16 keys' rows are transposed in registers so that lane j holds key j: dword p of the
//         block (dims 2p, 2p + 1 of each key) meets the query's dword p broadcast to every lane in
//         one vdpbf16ps (bf16 x bf16 products are exact in fp32), so each query head's 16 scores
//         come out as one register, with no horizontal sums and no widening of K.
//   P.V   keys outermost: each V row is read once, split into its even and odd dims as fp32 (a
//         shift and a mask: bf16 is the top half of an fp32) and multiplied into up to 7 heads x
//         64 dims of accumulators held in registers (the probabilities broadcast from memory).
// Probabilities and accumulation stay fp32 (as above); only the order of additions differs.

constexpr int64_t kKeysPerBlock = 16;  // keys transposed together: one per fp32 lane
// How far ahead the score pass requests key rows (into L2); it also requests each block's value
// rows as it scores the block, for the value pass after the softmax. A batch's rows are scattered
// over the pool and cold in every layer: with one key block ahead (and 8 value rows ahead in the
// value pass) the kernel waited on DRAM. 64 rows x 430 keys over 24 layers' pools, alternated
// builds: 27-29 -> 23.4-23.8 ms; 8 x 600: 3.9-4.1 -> 3.2-3.5 ms; cache-hot (one layer): +5%.
// A lone sequence (one row group) keeps the one-block-ahead prefetch: its blocks are mostly
// consecutive, which the hardware prefetchers follow, and there the far requests cost
// single-stream decode 3-4% (engine, 512-token context, alternated builds: 65.4-65.6 -> 62.9-63.1
// tokens/s).
constexpr int64_t kScorePrefetchKeys = 64;
constexpr int64_t kDwordsPerBlock = 16;  // dims 32 at a time = 16 bf16 pairs (one 512-bit row load)
constexpr int64_t kMaxHeadsPerPass = 8;  // query heads scored per pass over a key block (registers)
#if defined(__AVX512F__)
constexpr int64_t kMaxValueHeads = 7;    // P.V: 7 heads x 4 vectors = 28 accumulators + 4 V vectors
constexpr int64_t kValueBlocks = 2;      // 32-dim blocks of V per value pass
#else
// AVX2 (16 ymm registers, two per 16-lane vector): 3 heads x one 32-dim block = 12 accumulators + 4
// for the V row. 7 heads x 2 blocks (56 registers) spilled every accumulator on every key.
constexpr int64_t kMaxValueHeads = 3;
constexpr int64_t kValueBlocks = 1;
#endif
constexpr int64_t kMaxGroupHeads = 64;   // query heads of one attend_rows call (check_common: G <= 64)
// Rows that share their keys (row_groups) are grouped while the group has at most this many query
// heads: two score passes and three value passes per key block. Measured at GQA 3:1, D = 64, 2 KV
// heads, 600 keys in cache (one layer of the bundled target verifying 3 drafts): 4 rows one by one
// 33.5 us, grouped 21.5 us; 2 rows 17.9 -> 11.3 us. At GQA 7:1 only 2 rows fit: no pass is saved.
constexpr int64_t kGroupHeadsTarget = 16;

// The key rows of the work item a thread runs next, requested into L2 during this item's value
// pass: the score pass streams its keys (and requests its values) from DRAM while the value pass
// and softmax read only L2, so without this the bus idles in every value pass and the next score
// pass starts on cold keys. Rows are requested one per key of this item's pass (the first
// min(count, this item's keys); the score pass's own far prefetch covers any beyond). count = 0:
// none (the thread's last item, or a single row group, whose score pass keeps the near prefetch).
struct NextKeys {
  const int64_t* slots = nullptr;
  int64_t h = 0, count = 0;
};

struct Bf16Attention {
  const uint16_t* q;   // [B, Hq, D]
  const uint16_t* k;   // [S, Hkv, D]
  const uint16_t* v;   // [S, Hkv, D]
  const int64_t* slots;
  const int64_t* seq_lens;
  uint16_t* out;
  int64_t Hq, Hkv, D, slot_stride;
  float scale;
  const float* sinks;  // [Hq] sink logits, or nullptr: none
  kvflow::TransposeStages stages;

  const uint16_t* key_row(int64_t slot, int64_t h) const { return k + (slot * Hkv + h) * D; }
  const uint16_t* value_row(int64_t slot, int64_t h) const { return v + (slot * Hkv + h) * D; }

  // A score pass's requests before it scores keys [l0, l0 + block) of L. `far`: key rows up to
  // kScorePrefetchKeys past the block into L2 (`ahead`: keys requested so far, advanced here) and
  // the block's value rows; otherwise the next block's key rows.
  void prefetch_for_block(const int64_t* sl, int64_t h, int64_t L, int64_t l0, int64_t block, bool far,
                          int64_t& ahead) const {
    if (far) {
      for (const int64_t until = std::min(L, l0 + block + kScorePrefetchKeys); ahead < until; ++ahead)
        prefetch_row<_MM_HINT_T1>(key_row(sl[ahead], h), 2 * D);
      for (int64_t j = l0; j < std::min(L, l0 + block); ++j) prefetch_row<_MM_HINT_T1>(value_row(sl[j], h), 2 * D);
    } else {
      for (int64_t j = l0 + block; j < std::min(L, l0 + 2 * block); ++j) prefetch_row(key_row(sl[j], h), 2 * D);
    }
  }

  // scores[g * ld + l] = scale * <query head g, K[l]> for the GN <= kMaxHeadsPerPass query heads
  // qd[g] (bf16 pairs) and keys l < L: one transpose of each key block serves all GN heads.
  // `far`: request rows kScorePrefetchKeys ahead into L2, and each block's value rows (the first
  // pass over these keys in a call with several row groups); otherwise the next block's key rows.
  // GN is a template argument so that the accumulators stay in registers: with a run-time head
  // count every vdpbf16ps went through a stack slot (a store-to-load chain per head).
  template <int64_t GN>
  void score_pass(const int64_t* sl, int64_t h, const uint32_t* const* qd, int64_t L, int64_t ld, float* scores,
                  bool far) const {
    const int64_t dwords = D / 2, blocks = (dwords + kDwordsPerBlock - 1) / kDwordsPerBlock;
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t ahead = 0;  // keys [0, ahead) have been prefetched
    for (int64_t l0 = 0; l0 < L; l0 += kKeysPerBlock) {
      const int64_t nk = std::min(kKeysPerBlock, L - l0);
      prefetch_for_block(sl, h, L, l0, kKeysPerBlock, far, ahead);
      __m512 acc[GN];
      for (int64_t g = 0; g < GN; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t p0 = blk * kDwordsPerBlock, np = std::min(kDwordsPerBlock, dwords - p0);
        const __mmask16 cols = lanes_left(np);
        __m512i r[kKeysPerBlock];
        for (int64_t j = 0; j < kKeysPerBlock; ++j)
          r[j] = j < nk ? _mm512_maskz_loadu_epi32(cols, key_row(sl[l0 + j], h) + 2 * p0) : _mm512_setzero_si512();
        transpose16(r, stages);  // r[p] lane j = dword p0 + p of key l0 + j
        const auto dot = [&](int64_t p) {
          for (int64_t g = 0; g < GN; ++g)
            acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)r[p], (__m512bh)_mm512_set1_epi32(int32_t(qd[g][p0 + p])));
        };
        // Full blocks with a constant trip count: GCC then keeps this loop, the transpose and the
        // accumulators in one unspilled body (measured, 8 rows x 512 keys, one thread: 184 us
        // with only the run-time bound, 129 with this split; 151 before the pass was a template).
        if (np == kDwordsPerBlock) {
          for (int64_t p = 0; p < kDwordsPerBlock; ++p) dot(p);
        } else {
          for (int64_t p = 0; p < np; ++p) dot(p);
        }
      }
      for (int64_t g = 0; g < GN; ++g)
        _mm512_mask_storeu_ps(scores + g * ld + l0, lanes_left(nk), _mm512_mul_ps(acc[g], vscale));
    }
  }

#if !defined(__AVX512F__)
  // The AVX2 build's score pass (D a multiple of 16): score_pass's scores (summed in another
  // order) without its transposes: through avx512_on_avx2.h each key block's 16 x 16 dword transpose was 64 two-source
  // permutes of register pairs, and the 16 transposed rows (32 ymm) spilled. Here each key row is
  // read as it is, 16 dims per 32-byte load widened to fp32 (even dims by a shift, odd by a mask),
  // and multiplied into one accumulator per query head (the query widened once, in the same
  // even/odd order, read from L1 as FMA operands); every kAvx2Keys keys, each head's partial sums
  // are reduced across lanes into one vector of kAvx2Keys scores. A score's additions depend only
  // on its head and key, not on which others share the pass (grouped rows change no bit).
  static constexpr int64_t kAvx2Keys = 8;  // keys reduced together: one per fp32 lane of a ymm

  template <int64_t GN>
  void score_pass_avx2(const int64_t* sl, int64_t h, const uint32_t* const* qd, int64_t L, int64_t ld,
                       float* scores, bool far) const {
    const int64_t chunks = D / 16;
    const __m256i top = _mm256_set1_epi32(int32_t(0xffff0000u));
    alignas(32) float qf[GN * kMaxChunks * kLanes];  // [GN, D / 16, (8 even dims, 8 odd dims)], D <= 256
    for (int64_t g = 0; g < GN; ++g)
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qd[g] + 8 * c));
        _mm256_store_ps(qf + g * D + 16 * c, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        _mm256_store_ps(qf + g * D + 16 * c + 8, _mm256_castsi256_ps(_mm256_and_si256(x, top)));
      }
    const __m256 vscale = _mm256_set1_ps(scale);
    alignas(32) float partial[GN][kAvx2Keys][8];  // per head and key: 8 lanes summing to the dot product
    int64_t ahead = 0;  // keys [0, ahead) have been prefetched
    for (int64_t l0 = 0; l0 < L; l0 += kAvx2Keys) {
      const int64_t nk = std::min(kAvx2Keys, L - l0);
      prefetch_for_block(sl, h, L, l0, kAvx2Keys, far, ahead);
      for (int64_t j = 0; j < kAvx2Keys; ++j) {
        __m256 acc[GN];
        for (int64_t g = 0; g < GN; ++g) acc[g] = _mm256_setzero_ps();
        if (j < nk) {
          const uint16_t* key = key_row(sl[l0 + j], h);
          for (int64_t c = 0; c < chunks; ++c) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + 16 * c));
            const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
            const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(x, top));
            for (int64_t g = 0; g < GN; ++g) {
              acc[g] = _mm256_fmadd_ps(even, _mm256_load_ps(qf + g * D + 16 * c), acc[g]);
              acc[g] = _mm256_fmadd_ps(odd, _mm256_load_ps(qf + g * D + 16 * c + 8), acc[g]);
            }
          }
        }
        for (int64_t g = 0; g < GN; ++g) _mm256_store_ps(partial[g][j], acc[g]);
      }
      for (int64_t g = 0; g < GN; ++g) {  // lane j of the result: the sum of partial[g][j]'s 8 lanes
        const auto row = [&](int64_t j) { return _mm256_load_ps(partial[g][j]); };
        const __m256 t0 = _mm256_hadd_ps(row(0), row(1)), t1 = _mm256_hadd_ps(row(2), row(3));
        const __m256 t2 = _mm256_hadd_ps(row(4), row(5)), t3 = _mm256_hadd_ps(row(6), row(7));
        const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half
        const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
        alignas(32) float out[kAvx2Keys];
        _mm256_store_ps(out, _mm256_mul_ps(dots, vscale));
        std::memcpy(scores + g * ld + l0, out, nk * sizeof(float));
      }
    }
  }
#endif

  void score_heads(const int64_t* sl, int64_t h, const uint32_t* const* qd, int64_t GN, int64_t L, int64_t ld,
                   float* scores, bool far) const {
    static_assert(kMaxHeadsPerPass == 8, "with_row_count dispatches counts up to 8");
#if !defined(__AVX512F__)
    if (D % 16 == 0) {
      kvflow::with_row_count(GN, [&](auto heads) {
        score_pass_avx2<decltype(heads)::value>(sl, h, qd, L, ld, scores, far);
      });
      return;
    }
#endif
    kvflow::with_row_count(GN, [&](auto heads) { score_pass<decltype(heads)::value>(sl, h, qd, L, ld, scores, far); });
  }

  // acc_out[g][d] = sum_{l < ends[g]} probs[g * ld + l] * V[l][d] for dims [32 * blk0, 32 * blk0 + 32 NB),
  // heads g < GN, where ends[g] >= L_common. Accumulators per head: [even dims, odd dims] per 32-dim
  // block. Keys [L_common, max end) are added only to the heads that attend them, so a head's sum is
  // the same sequence of additions as when it is computed alone.
  template <int64_t GN, int64_t NB>
  void value_pass(const int64_t* sl, int64_t h, int64_t L_common, const int64_t* ends, int64_t blk0,
                  const float* probs, int64_t ld, float* acc_out, NextKeys next) const {
    __m512 acc[GN][2 * NB];
    for (int64_t g = 0; g < GN; ++g)
      for (int64_t c = 0; c < 2 * NB; ++c) acc[g][c] = _mm512_setzero_ps();
    __mmask32 masks[NB];
    for (int64_t n = 0; n < NB; ++n) {
      const int64_t left = D - 32 * (blk0 + n);
      masks[n] = left >= 32 ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    }
    int64_t L = L_common;
    for (int64_t g = 0; g < GN; ++g) L = std::max(L, ends[g]);
    const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
    for (int64_t l = 0; l < L; ++l) {
      if (l + kPrefetchKeys < L) prefetch_row(value_row(sl[l + kPrefetchKeys], h) + 32 * blk0, 64 * NB);
      if (l < next.count) prefetch_row<_MM_HINT_T1>(key_row(next.slots[l], next.h), 2 * D);
      const uint16_t* row = value_row(sl[l], h) + 32 * blk0;
      __m512 vv[2 * NB];
      for (int64_t n = 0; n < NB; ++n) {
        const __m512i x = _mm512_maskz_loadu_epi16(masks[n], row + 32 * n);
        vv[2 * n] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));      // dims 2i
        vv[2 * n + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));  // dims 2i + 1
      }
      const bool tail = l >= L_common;
      for (int64_t g = 0; g < GN; ++g) {
        if (tail && l >= ends[g]) continue;
        const __m512 p = _mm512_set1_ps(probs[g * ld + l]);
        for (int64_t c = 0; c < 2 * NB; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < GN; ++g)
      for (int64_t c = 0; c < 2 * NB; ++c) _mm512_storeu_ps(acc_out + (g * 2 * NB + c) * kLanes, acc[g][c]);
  }

  template <int64_t NB>
  void value_heads(const int64_t* sl, int64_t h, int64_t L_common, const int64_t* ends, int64_t GN, int64_t blk0,
                   const float* probs, int64_t ld, float* acc_out, NextKeys next) const {
    switch (GN) {
      case 1: value_pass<1, NB>(sl, h, L_common, ends, blk0, probs, ld, acc_out, next); break;
      case 2: value_pass<2, NB>(sl, h, L_common, ends, blk0, probs, ld, acc_out, next); break;
      case 3: value_pass<3, NB>(sl, h, L_common, ends, blk0, probs, ld, acc_out, next); break;
      case 4: value_pass<4, NB>(sl, h, L_common, ends, blk0, probs, ld, acc_out, next); break;
      case 5: value_pass<5, NB>(sl, h, L_common, ends, blk0, probs, ld, acc_out, next); break;
      case 6: value_pass<6, NB>(sl, h, L_common, ends, blk0, probs, ld, acc_out, next); break;
      default: value_pass<7, NB>(sl, h, L_common, ends, blk0, probs, ld, acc_out, next); break;
    }
  }

  // Rows b0 .. b0 + R - 1 whose keys are leading entries of one slot list `sl` (row_groups below),
  // KV head h: their R x G query heads ("virtual heads", row-major) are scored against each
  // transposed key block together and share every V row read. Each head's softmax and P.V run
  // over its own row's keys only, with the additions in the same order as a row computed alone,
  // so grouping changes no output bit.
  void attend_rows(int64_t b0, int64_t R, const int64_t* sl, int64_t h, bool far_prefetch, NextKeys next,
                   std::vector<float>& scratch) const {
    const int64_t G = Hq / Hkv, VH = R * G, blocks32 = (D + 31) / 32;
    int64_t L_min = seq_lens[b0], L_max = seq_lens[b0];
    for (int64_t r = 1; r < R; ++r) {
      L_min = std::min(L_min, seq_lens[b0 + r]);
      L_max = std::max(L_max, seq_lens[b0 + r]);
    }
    scratch.resize(VH * L_max + kMaxValueHeads * 4 * kLanes);
    float* scores = scratch.data();  // [VH, L_max]
    float* acc = scores + VH * L_max;  // one value pass's accumulators, [GN][2 NB][16]
    const uint32_t* qd[kMaxGroupHeads];
    int64_t ends[kMaxGroupHeads];
    for (int64_t v = 0; v < VH; ++v) {
      const int64_t b = b0 + v / G, g = v % G;
      qd[v] = reinterpret_cast<const uint32_t*>(q + (b * Hq + h * G + g) * D);
      ends[v] = seq_lens[b];
    }
    for (int64_t v0 = 0; v0 < VH; v0 += kMaxHeadsPerPass)
      score_heads(sl, h, qd + v0, std::min(kMaxHeadsPerPass, VH - v0), L_max, L_max, scores + v0 * L_max,
                  far_prefetch && v0 == 0);
    float inv_sum[kMaxGroupHeads];
    for (int64_t v = 0; v < VH; ++v)
      inv_sum[v] = softmax_unnormalised(scores + v * L_max, ends[v], sink_of(sinks, h * G + v % G));
    for (int64_t blk0 = 0; blk0 < blocks32; blk0 += kValueBlocks) {
      const int64_t NB = std::min<int64_t>(kValueBlocks, blocks32 - blk0);
      for (int64_t v0 = 0; v0 < VH; v0 += kMaxValueHeads) {
        const int64_t GN = std::min(kMaxValueHeads, VH - v0);
        const float* probs = scores + v0 * L_max;
        const NextKeys once = blk0 == 0 && v0 == 0 ? next : NextKeys{};
        if (NB == 2) value_heads<2>(sl, h, L_min, ends + v0, GN, blk0, probs, L_max, acc, once);
        else value_heads<1>(sl, h, L_min, ends + v0, GN, blk0, probs, L_max, acc, once);
        for (int64_t g = 0; g < GN; ++g) {
          const int64_t v = v0 + g, b = b0 + v / G;
          uint16_t* o = out + (b * Hq + h * G + v % G) * D;
          for (int64_t n = 0; n < NB; ++n)
            for (int64_t i = 0; i < kLanes; ++i) {
              const int64_t d = 32 * (blk0 + n) + 2 * i;
              if (d >= D) break;
              const float* a = acc + (g * 2 * NB + 2 * n) * kLanes;
              o[d] = kvflow::float_to_bf16(a[i] * inv_sum[v]);
              o[d + 1] = kvflow::float_to_bf16(a[kLanes + i] * inv_sum[v]);
            }
        }
      }
    }
  }
};

// Runs of consecutive rows whose keys are leading entries of one slot list: each row's first
// seq_len entries equal those of the run's longest row (speculative verification rows of one
// request, the rows of a short chunk). (first row, row count, the longest row's slots) per run,
// each run at most max_rows long. Comparing slot lists costs O(keys) integer reads per row, far
// below the attention itself; rows of different requests differ at their first slot, unless they
// share cached prefix blocks and read only those, in which case reading them as one run is exact.
struct RowGroup {
  int64_t b0, rows;
  const int64_t* slots;  // the longest row's slot list: every row of the run reads a prefix of it
  int64_t max_len;
};

std::vector<RowGroup> row_groups(const int64_t* slots, int64_t slot_stride, const int64_t* seq_lens, int64_t B,
                                 int64_t max_rows) {
  std::vector<RowGroup> groups;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* sl = slots + b * slot_stride;
    if (!groups.empty()) {
      RowGroup& g = groups.back();
      const int64_t common = std::min(seq_lens[b], g.max_len);
      if (g.rows < max_rows && (sl == g.slots || std::memcmp(sl, g.slots, common * sizeof(int64_t)) == 0)) {
        if (seq_lens[b] > g.max_len) g.slots = sl, g.max_len = seq_lens[b];
        ++g.rows;
        continue;
      }
    }
    groups.push_back({b, 1, sl, seq_lens[b]});
  }
  return groups;
}

template <typename Rows>
void run_all(const Problem<Rows>& P, int64_t B) {
  at::parallel_for(0, B * P.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) attend_one(P, i / P.Hkv, i % P.Hkv, scratch);
  });
}

void check_common(const at::Tensor& q, const at::Tensor& slots, const at::Tensor& seq_lens, int64_t Hkv) {
  TORCH_CHECK(q.dtype() == at::kBFloat16, "bf16 queries expected");
  TORCH_CHECK(slots.dtype() == at::kLong && seq_lens.dtype() == at::kLong, "int64 slots/seq_lens expected");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && slots.size(0) == B && seq_lens.size(0) == B, "shapes");
  TORCH_CHECK(D <= kMaxChunks * kLanes && Hq / Hkv <= 64, "head_dim <= 256 and <= 64 query heads per KV head");
}

template <typename Rows>
at::Tensor launch(at::Tensor q, Rows k, Rows v, at::Tensor slots, at::Tensor seq_lens, double scale,
                     const float* sinks) {
  auto out = kvflow::empty_like(q);
  const Problem<Rows> P{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), k, v,
                        slots.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                        q.size(1), k.Hkv, q.size(2), slots.stride(0), static_cast<float>(scale), sinks};
  run_all(P, q.size(0));
  return out;
}

}  // namespace

// sinks: [Hq] fp32 sink logits (attention_sinks.h), or none.
at::Tensor paged_decode_attention_bf16(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                          at::Tensor slots, at::Tensor seq_lens, double scale,
                                          c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(key_cache.dtype() == at::kBFloat16 && value_cache.dtype() == at::kBFloat16, "bf16 k/v expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV pools must be contiguous");
  q = q.contiguous();
  // Rows may share one slot list (stride 0); keys must be unit-stride.
  if (slots.stride(1) != 1) slots = slots.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t Hkv = key_cache.size(1), D = q.size(2);
  check_common(q, slots, seq_lens, Hkv);
  TORCH_CHECK(key_cache.size(2) == D, "head_dim mismatch");
  at::Tensor sinks_kept;
  const float* sp = kvflow::sink_logits(sinks, q.size(1), sinks_kept);
  const auto* kp = reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>());
  if (D % 2 != 0)  // the keys-along-lanes path reads bf16 pairs
    return launch(q, Bf16Rows{kp, Hkv, D}, Bf16Rows{vp, Hkv, D}, slots, seq_lens, scale, sp);
  auto out = kvflow::empty_like(q);
  const Bf16Attention A{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), kp, vp,
                        slots.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                        q.size(1), Hkv, D, slots.stride(0), static_cast<float>(scale), sp};
  const int64_t G = q.size(1) / Hkv;
  const std::vector<RowGroup> groups = row_groups(A.slots, A.slot_stride, A.seq_lens, q.size(0),
                                                  std::max<int64_t>(1, kGroupHeadsTarget / G));
  const bool far_prefetch = groups.size() > 1;  // kScorePrefetchKeys
  at::parallel_for(0, int64_t(groups.size()) * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const RowGroup& g = groups[i / Hkv];
      NextKeys next;
      if (far_prefetch && i + 1 < end) {
        const RowGroup& n = groups[(i + 1) / Hkv];
        next = {n.slots, (i + 1) % Hkv, n.max_len};
      }
      A.attend_rows(g.b0, g.rows, g.slots, i % Hkv, far_prefetch, next, scratch);
    }
  });
  return out;
}

// kind: "int8" | "fp8_e4m3" | "int4". k_data/v_data: [S, Hkv, D] (int4: [S, Hkv, D / 2] uint8);
// scales and zeros [S, Hkv] fp16 (zeros only for int4; pass the scales otherwise, unused). sinks:
// [Hq] fp32 sink logits (attention_sinks.h), or none.
at::Tensor paged_decode_attention_quantized(at::Tensor q, at::Tensor k_data, at::Tensor k_scale,
                                               at::Tensor k_zero, at::Tensor v_data, at::Tensor v_scale,
                                               at::Tensor v_zero, at::Tensor slots, at::Tensor seq_lens,
                                               double scale, const std::string& kind,
                                               c10::optional<at::Tensor> sinks) {
  for (const auto* t : {&k_data, &k_scale, &k_zero, &v_data, &v_scale, &v_zero})
    TORCH_CHECK(t->is_contiguous(), "KV pools must be contiguous");
  TORCH_CHECK(k_scale.dtype() == at::kHalf && v_scale.dtype() == at::kHalf, "fp16 scales expected");
  q = q.contiguous();
  // Rows may share one slot list (stride 0); keys must be unit-stride.
  if (slots.stride(1) != 1) slots = slots.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t Hkv = k_data.size(1), D = q.size(2);
  check_common(q, slots, seq_lens, Hkv);
  at::Tensor sinks_kept;
  const float* sp = kvflow::sink_logits(sinks, q.size(1), sinks_kept);
  const auto* ks = reinterpret_cast<const uint16_t*>(k_scale.data_ptr<at::Half>());
  const auto* vs = reinterpret_cast<const uint16_t*>(v_scale.data_ptr<at::Half>());
  if (kind == "int8") {
    TORCH_CHECK(k_data.dtype() == at::kChar && k_data.size(2) == D, "int8 [S, Hkv, D] pools expected");
    return launch(q, Int8Rows{k_data.data_ptr<int8_t>(), ks, Hkv, D}, Int8Rows{v_data.data_ptr<int8_t>(), vs, Hkv, D},
                  slots, seq_lens, scale, sp);
  }
  if (kind == "fp8_e4m3") {
    TORCH_CHECK(k_data.dtype() == at::kByte && k_data.size(2) == D, "fp8 bytes [S, Hkv, D] expected");
    return launch(q, Fp8Rows{k_data.data_ptr<uint8_t>(), ks, Hkv, D}, Fp8Rows{v_data.data_ptr<uint8_t>(), vs, Hkv, D},
                  slots, seq_lens, scale, sp);
  }
  TORCH_CHECK(kind == "int4", "unknown KV format ", kind);
  TORCH_CHECK(k_data.dtype() == at::kByte && D % 2 == 0 && k_data.size(2) == D / 2, "int4 [S, Hkv, D/2] expected");
  TORCH_CHECK(k_zero.dtype() == at::kHalf && v_zero.dtype() == at::kHalf, "fp16 zeros expected");
  const auto* kz = reinterpret_cast<const uint16_t*>(k_zero.data_ptr<at::Half>());
  const auto* vz = reinterpret_cast<const uint16_t*>(v_zero.data_ptr<at::Half>());
  return launch(q, Int4Rows{k_data.data_ptr<uint8_t>(), ks, kz, Hkv, D},
                Int4Rows{v_data.data_ptr<uint8_t>(), vs, vz, Hkv, D}, slots, seq_lens, scale, sp);
}
