// Causal attention of one prefill chunk over its keys in the paged bf16 KV pool, flash style.
//
// Problem: n query tokens q [n, Hq, D] are the last n of the chunk's L keys (slots [L] into the
// pools [S, Hkv, D], in position order, the chunk's own K/V already written); query token i
// attends keys [0, L - n + i + 1). GQA: query head h * G + g reads KV head h (G = Hq / Hkv).
//
// Why: the decode kernel run with one row per query token (paged_decode_attention.cpp) transposes
// every key block again for each token and widens every V row again, so a 512-token chunk ran at
// ~135 GFLOP/s while the linears around it run at ~900 (benchmarks/NOTES.md). Here:
//   1. Each KV head's keys are packed once per call into the layouts vdpbf16ps wants: K in
//      transposed blocks of 16 keys (dword p, i.e. dims 2p and 2p + 1, of 16 keys in one
//      register, against a query's dword p broadcast), V as pairs of keys interleaved per dim
//      (dword d of pair j = (V[2j][d], V[2j + 1][d]), against a broadcast pair of probabilities).
//   2. Query tiles of ~kTileVectorsTarget query vectors ((token, head) pairs of one KV head) walk
//      key tiles of kKeyTile keys with an online softmax (running max m, sum l, output O):
//        S = scale * Q K^T                  8 query vectors x 32 keys per micro-kernel
//        m' = max(m, rowmax S), alpha = exp(m - m'), P = exp(S - m')
//        l = l * alpha + rowsum P,  O = O * alpha + P V    4 query vectors x 64 dims per micro-kernel
//      and O / l is the output. Both products are vdpbf16ps chains with 16 independent
//      accumulators over operands in L1/L2.
//   3. A sink logit s (gpt-oss, optional; attention_sinks.h) is the start value of the online
//      softmax: m = s, l = exp(s - s) = 1, O = 0 (it has no value). Without sinks m = -inf, l = 0.
// Numerics: scores, maxima, sums and O are fp32; P is rounded to bf16 for the product with V (as
// torch's CPU flash attention does for bf16 inputs): ~2^-9 relative per weight, averaged over the
// keys. The output is rounded to bf16 once.

#include <ATen/Parallel.h>
#include "aten_lite.h"
#include "simd.h"

#include "attention_simd.h"
#include "attention_sinks.h"
#include "bf16_utils.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;             // fp32 lanes (or bf16 pairs) per 512-bit register
constexpr int64_t kKeyBlock = 16;          // keys per transposed block (one per lane)
// Keys per online-softmax step. Longer tiles spread each row's max, rescale and sums over more keys
// but waste more of the causal diagonal; measured (GQA 7:1, D = 64, 2 threads, ms at 512 / 2,048 /
// 4,096 causal tokens): 64 keys 0.96 / 13.9 / 53.3, 128 keys 0.85 / 12.6 / 48.7, 256 keys 0.83 /
// 12.2 / 46.8 (S then 64 KiB, in L2). 128 query vectors per tile instead of 64: no better at 2,048,
// worse below 512.
constexpr int64_t kKeyTile = 256;
constexpr int64_t kScoreVectors = 8;       // query vectors per Q.K micro-kernel (x 2 key blocks)
constexpr int64_t kValueVectors = 4;       // query vectors per P.V micro-kernel (x 4 dim registers)
constexpr int64_t kDimSlice = 64;          // dims per P.V micro-kernel pass (4 registers of 16)
constexpr int64_t kTileVectorsTarget = 64; // query vectors per tile: O 16 KiB at D = 64

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Element i of 32 bf16 (a in 0..15, b in 16..31) -> interleaved (a0, b0, a1, b1, ...).
__m512i pair_interleave_index() {
  alignas(64) int16_t idx[32];
  for (int16_t i = 0; i < 16; ++i) {
    idx[2 * i] = i;
    idx[2 * i + 1] = int16_t(16 + i);
  }
  return _mm512_load_si512(idx);
}

struct Chunk {
  const uint16_t* q;      // [n, Hq, D]
  const uint16_t* k;      // pool [S, Hkv, D]
  const uint16_t* v;      // pool [S, Hkv, D]
  const int64_t* slots;   // [L]
  uint16_t* out;          // [n, Hq, D]
  int64_t n, L, Hq, Hkv, D;
  float scale;
  // Derived: dwords per key row, padded dims of a V pair row, padded key count.
  int64_t Dw, Dv, L_pad;
  uint32_t* kt;  // [Hkv][L_pad / 16][Dw][16]
  uint32_t* vp;  // [Hkv][L_pad / 2][Dv]
  const float* sinks;  // [Hq] sink logits, or nullptr: none

  uint32_t* kt_head(int64_t h) const { return kt + h * L_pad * Dw; }
  uint32_t* vp_head(int64_t h) const { return vp + h * (L_pad / 2) * Dv; }

  // Key block b (keys 16b .. 16b + 15) of KV head h into both packed layouts; keys >= L are zeros.
  void pack_block(int64_t h, int64_t b, const kvflow::TransposeStages& stages, __m512i interleave) const {
    const auto row = [&](const uint16_t* pool, int64_t key) { return pool + (slots[key] * Hkv + h) * D; };
    uint32_t* kt_b = kt_head(h) + b * Dw * kKeyBlock;
    for (int64_t p0 = 0; p0 < Dw; p0 += kLanes) {
      const int64_t np = std::min(kLanes, Dw - p0);
      const __mmask16 cols = kvflow::lanes_left(np);
      __m512i r[kKeyBlock];
      for (int64_t j = 0; j < kKeyBlock; ++j) {
        const int64_t key = b * kKeyBlock + j;
        r[j] = key < L ? _mm512_maskz_loadu_epi32(cols, row(k, key) + 2 * p0) : _mm512_setzero_si512();
      }
      kvflow::transpose16(r, stages);  // r[p] lane j = dword p0 + p of key 16b + j
      for (int64_t p = 0; p < np; ++p) _mm512_storeu_si512(kt_b + (p0 + p) * kKeyBlock, r[p]);
    }
    for (int64_t jp = 0; jp < kKeyBlock / 2; ++jp) {
      const int64_t key0 = b * kKeyBlock + 2 * jp, key1 = key0 + 1;
      uint32_t* dst = vp_head(h) + (key0 / 2) * Dv;
      for (int64_t d0 = 0; d0 < Dv; d0 += kLanes) {
        const __mmask16 dims = kvflow::lanes_left(D - d0);
        const __m256i a = key0 < L ? _mm256_maskz_loadu_epi16(dims, row(v, key0) + d0) : _mm256_setzero_si256();
        const __m256i c = key1 < L ? _mm256_maskz_loadu_epi16(dims, row(v, key1) + d0) : _mm256_setzero_si256();
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
        _mm512_storeu_si512(dst + d0, _mm512_permutexvar_epi16(interleave, both));
      }
    }
  }
};

// S[i][16b + j] = scale * <q_i, key 16(kb + b) + j> for kScoreVectors query vectors and NB key
// blocks from block kb of the packed keys.
template <int NB>
inline void score_tile(const uint32_t* const* qrow, const uint32_t* kt, int64_t Dw, float scale, float* S,
                       int64_t lds) {
  __m512 acc[kScoreVectors][NB];
  for (int64_t i = 0; i < kScoreVectors; ++i)
    for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < Dw; ++p) {
    __m512bh kk[NB];
    for (int b = 0; b < NB; ++b) kk[b] = (__m512bh)_mm512_loadu_si512(kt + (b * Dw + p) * kKeyBlock);
    for (int64_t i = 0; i < kScoreVectors; ++i) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(int32_t(qrow[i][p]));
      for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], kk[b], qb);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < kScoreVectors; ++i)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(S + i * lds + b * kLanes, _mm512_mul_ps(acc[i][b], vscale));
}

// O[i][16s ..] = O[i] * alpha[i] + sum_j P[i][j] . Vpair[j] over `pairs` key pairs, for
// kValueVectors query vectors and NS registers of 16 dims.
template <int NS>
inline void value_tile(const uint32_t* P, int64_t ldp, const uint32_t* vp, int64_t Dv, int64_t pairs, const float* alpha,
                       float* O, int64_t ldo) {
  __m512 acc[kValueVectors][NS];
  for (int64_t i = 0; i < kValueVectors; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[i]);
    for (int s = 0; s < NS; ++s) acc[i][s] = _mm512_mul_ps(_mm512_loadu_ps(O + i * ldo + s * kLanes), a);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh vv[NS];
    for (int s = 0; s < NS; ++s) vv[s] = (__m512bh)_mm512_loadu_si512(vp + j * Dv + s * kLanes);
    for (int64_t i = 0; i < kValueVectors; ++i) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(int32_t(P[i * ldp + j]));
      for (int s = 0; s < NS; ++s) acc[i][s] = _mm512_dpbf16_ps(acc[i][s], vv[s], pb);
    }
  }
  for (int64_t i = 0; i < kValueVectors; ++i)
    for (int s = 0; s < NS; ++s) _mm512_storeu_ps(O + i * ldo + s * kLanes, acc[i][s]);
}

// A thread's working set for one query tile.
struct TileScratch {
  std::vector<float> S, O, m, l, alpha;
  std::vector<uint32_t> P, zero_row;
  std::vector<const uint32_t*> qrow;
  std::vector<int64_t> limit;
};

// Query tokens [t0, t1) of KV head h: V = (t1 - t0) * G query vectors, padded to V_pad.
void attend_tile(const Chunk& c, int64_t h, int64_t t0, int64_t t1, TileScratch& w) {
  const int64_t G = c.Hq / c.Hkv, V = (t1 - t0) * G;
  const int64_t V_pad = round_up(V, std::max(kScoreVectors, kValueVectors));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  w.S.resize(V_pad * kKeyTile);
  w.P.assign(V_pad * kKeyTile / 2, 0u);  // padded vectors' rows stay zero
  w.O.assign(V_pad * c.Dv, 0.0f);
  w.m.assign(V_pad, kNegInf);
  w.l.assign(V_pad, 0.0f);
  w.alpha.assign(V_pad, 1.0f);
  w.zero_row.assign(c.Dw, 0u);
  w.qrow.resize(V_pad);
  w.limit.resize(V_pad);
  for (int64_t i = 0; i < V_pad; ++i) {
    const int64_t t = t0 + i / G, g = i % G;
    const bool real = i < V;
    w.qrow[i] = real ? reinterpret_cast<const uint32_t*>(c.q + (t * c.Hq + h * G + g) * c.D) : w.zero_row.data();
    w.limit[i] = real ? c.L - c.n + t + 1 : 0;  // keys [0, limit) visible
    if (real && c.sinks != nullptr) {  // the sink as the softmax's start: max s, sum exp(s - s)
      w.m[i] = c.sinks[h * G + g];
      w.l[i] = w.m[i] == kNegInf ? 0.0f : 1.0f;
    }
  }
  const int64_t keys_needed = c.L - c.n + t1;  // the tile's last token sees this many
  const uint32_t* kt = c.kt_head(h);
  const uint32_t* vp = c.vp_head(h);
  for (int64_t k0 = 0; k0 < keys_needed; k0 += kKeyTile) {
    const int64_t blocks = std::min(kKeyTile, round_up(keys_needed - k0, kKeyBlock)) / kKeyBlock;
    const int64_t width = blocks * kKeyBlock, kb = k0 / kKeyBlock;
    for (int64_t i0 = 0; i0 < V_pad; i0 += kScoreVectors) {
      int64_t b = 0;
      for (; b + 2 <= blocks; b += 2)
        score_tile<2>(&w.qrow[i0], kt + (kb + b) * c.Dw * kKeyBlock, c.Dw, c.scale, &w.S[i0 * kKeyTile + b * kKeyBlock],
                      kKeyTile);
      if (b < blocks)
        score_tile<1>(&w.qrow[i0], kt + (kb + b) * c.Dw * kKeyBlock, c.Dw, c.scale, &w.S[i0 * kKeyTile + b * kKeyBlock],
                      kKeyTile);
    }
    for (int64_t i = 0; i < V; ++i) {  // online softmax of row i over this tile's visible keys
      const int64_t visible = std::clamp<int64_t>(w.limit[i] - k0, 0, width);
      uint32_t* prow = &w.P[i * kKeyTile / 2];
      if (visible == 0) {
        std::fill(prow, prow + width / 2, 0u);
        w.alpha[i] = 1.0f;
        continue;
      }
      const float* srow = &w.S[i * kKeyTile];
      __m512 vmax = _mm512_set1_ps(kNegInf);
      for (int64_t j = 0; j < visible; j += kLanes) {
        const __mmask16 mask = kvflow::lanes_left(visible - j);
        vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_maskz_loadu_ps(mask, srow + j));
      }
      const float m_new = std::max(w.m[i], _mm512_reduce_max_ps(vmax));
      w.alpha[i] = w.m[i] == kNegInf ? 0.0f : std::exp(w.m[i] - m_new);
      w.m[i] = m_new;
      const __m512 vm = _mm512_set1_ps(m_new);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t j = 0; j < width; j += 2 * kLanes) {
        // Keys past `visible` (masked: causal, or past L) get exactly 0.
        const __mmask16 lo = kvflow::lanes_left(std::max<int64_t>(0, visible - j));
        const __mmask16 hi = kvflow::lanes_left(std::max<int64_t>(0, visible - j - kLanes));
        const __m512 e0 = _mm512_maskz_mov_ps(lo, kvflow::exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(srow + j), vm)));
        const __m512 e1 = j + kLanes < width ? _mm512_maskz_mov_ps(
                                                   hi, kvflow::exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(srow + j + kLanes), vm)))
                                             : _mm512_setzero_ps();
        vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
        // bf16 element e = P[j + e]: dword (j + e) / 2 pairs keys (2k, 2k + 1), as the V pairs do.
        _mm512_storeu_si512(prow + j / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      }
      w.l[i] = w.l[i] * w.alpha[i] + _mm512_reduce_add_ps(vsum);
    }
    const uint32_t* vp_tile = vp + (k0 / 2) * c.Dv;
    for (int64_t i0 = 0; i0 < V_pad; i0 += kValueVectors)
      for (int64_t s0 = 0; s0 < c.Dv; s0 += kDimSlice) {
        const uint32_t* P = &w.P[i0 * kKeyTile / 2];
        const float* alpha = &w.alpha[i0];
        float* O = &w.O[i0 * c.Dv + s0];
        switch (std::min(kDimSlice, c.Dv - s0) / kLanes) {
          case 1: value_tile<1>(P, kKeyTile / 2, vp_tile + s0, c.Dv, width / 2, alpha, O, c.Dv); break;
          case 2: value_tile<2>(P, kKeyTile / 2, vp_tile + s0, c.Dv, width / 2, alpha, O, c.Dv); break;
          case 3: value_tile<3>(P, kKeyTile / 2, vp_tile + s0, c.Dv, width / 2, alpha, O, c.Dv); break;
          default: value_tile<4>(P, kKeyTile / 2, vp_tile + s0, c.Dv, width / 2, alpha, O, c.Dv); break;
        }
      }
  }
  for (int64_t i = 0; i < V; ++i) {
    const int64_t t = t0 + i / G, g = i % G;
    const __m512 inv = _mm512_set1_ps(1.0f / w.l[i]);
    uint16_t* o = c.out + (t * c.Hq + h * G + g) * c.D;
    for (int64_t d = 0; d < c.D; d += kLanes)
      kvflow::store_bf16_lanes(o + d, _mm512_mul_ps(_mm512_loadu_ps(&w.O[i * c.Dv + d]), inv),
                               kvflow::lanes_left(c.D - d));
  }
}

}  // namespace

// q [n, Hq, D] bf16 (the chunk's queries, the last n of its L positions), key_cache / value_cache
// [S, Hkv, D] bf16 pools holding the chunk's keys at slots [L] (position order) -> [n, Hq, D] bf16.
// sinks: [Hq] fp32 sink logits (attention_sinks.h), or none.
at::Tensor prefill_attention_bf16(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                     at::Tensor slots, double scale, c10::optional<at::Tensor> sinks) {
  TORCH_CHECK(q.dtype() == at::kBFloat16 && key_cache.dtype() == at::kBFloat16 &&
                  value_cache.dtype() == at::kBFloat16,
              "bf16 queries and pools expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV pools must be contiguous");
  TORCH_CHECK(slots.dtype() == at::kLong && slots.dim() == 1, "slots: [L] int64");
  q = q.contiguous();
  slots = slots.contiguous();
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = key_cache.size(1), L = slots.size(0);
  TORCH_CHECK(key_cache.size(2) == D && value_cache.size(2) == D, "head_dim mismatch");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even (keys are read as bf16 pairs)");
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= kTileVectorsTarget, "at most 64 query heads per KV head");
  TORCH_CHECK(n <= L, "more queries than keys");
  at::Tensor sinks_kept;
  const float* sp = kvflow::sink_logits(sinks, Hq, sinks_kept);
  auto out = kvflow::empty_like(q);
  if (n == 0) return out;
  const int64_t Dw = D / 2, Dv = round_up(D, kLanes), L_pad = round_up(L, kKeyTile);
  auto kt = kvflow::empty({Hkv * L_pad * Dw}, at::kInt);
  auto vp = kvflow::empty({Hkv * (L_pad / 2) * Dv}, at::kInt);
  const Chunk c{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(key_cache.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(value_cache.data_ptr<at::BFloat16>()),
                slots.data_ptr<int64_t>(),
                reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                n, L, Hq, Hkv, D, static_cast<float>(scale), Dw, Dv, L_pad,
                reinterpret_cast<uint32_t*>(kt.data_ptr<int32_t>()),
                reinterpret_cast<uint32_t*>(vp.data_ptr<int32_t>()), sp};
  const int64_t blocks = L_pad / kKeyBlock;
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    const kvflow::TransposeStages stages;
    const __m512i interleave = pair_interleave_index();
    for (int64_t i = begin; i < end; ++i) c.pack_block(i / blocks, i % blocks, stages, interleave);
  });
  // Query tiles of one KV head, in zig-zag order (first, last, second, ...): a contiguous share
  // of the items then holds early (short) and late (long) causal rows alike.
  const int64_t G = Hq / Hkv, tokens_per_tile = std::max<int64_t>(1, kTileVectorsTarget / G);
  const int64_t tiles = (n + tokens_per_tile - 1) / tokens_per_tile;
  at::parallel_for(0, Hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    TileScratch w;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / tiles, r = i % tiles, tile = r % 2 == 0 ? r / 2 : tiles - 1 - r / 2;
      const int64_t t0 = tile * tokens_per_tile;
      attend_tile(c, h, t0, std::min(n, t0 + tokens_per_tile), w);
    }
  });
  return out;
}
