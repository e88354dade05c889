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
#include "aten_lite.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxRows = 8;
constexpr float kFp16Rebias = 256.0f;  // 2^(15 - 7): the widened value is e4m3 * 2^-8
// Bytes of a weight stream prefetched ahead of its loads: 1-2 KiB measured best (1 row of N 4864 x
// K 896, 2 threads, alternated: 512 B 83%, 1 KiB 96%, 2 KiB 97%, 8 KiB 76%, none 85% of a sum's
// bandwidth; benchmarks/NOTES.md, session 20).
constexpr int64_t kPrefetchAhead = 2048;

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

#if defined(__AVX512F__)
// The table form, on CPUs with AVX512-VBMI (Ice Lake and later, Zen 4 and later): vpermi2b looks
// up 64 weights' bf16 bytes at once in two 128-entry tables indexed by the 7 magnitude bits (it
// ignores the index's top bit, which is the e4m3 sign), one vpternlogd ORs the sign into the high
// byte, two vpunpck{l,h}bw interleave the bytes into 64 bf16 weights, and two vdpbf16ps multiply
// them with 64 bf16 activations: 7 vector operations per 64 weights against 36 for the
// bit-manipulation form above. Exact: every e4m3 value, subnormals included, is a normal bf16, so
// vdpbf16ps's flush of bf16 subnormals never touches a weight (0x7f, e4m3's NaN, maps to a NaN).
// vpunpck*bw interleave within each 128-bit lane, so the activations are laid out once per call
// in the same order (x_table_layout); the dot product does not care which lane holds which input.
constexpr int64_t kChunk = 64;  // weights per table lookup: one zmm of bytes

struct E4m3Tables {
  __m512i lo0, lo1, hi0, hi1;  // bf16 low / high bytes of magnitudes 0..63 and 64..127
};

// The tables' bytes, built once per process (a GEMV call only loads them into registers).
struct E4m3TableBytes {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
};

const E4m3TableBytes& e4m3_table_bytes() {
  static const E4m3TableBytes table = [] {
    E4m3TableBytes t{};
    for (int i = 0; i < 128; ++i) {
      uint16_t b = 0x7fc0;  // 0x7f: e4m3's NaN
      if (i != 0x7f) {
        const float v = e4m3_to_float(static_cast<uint8_t>(i));
        uint32_t bits;
        std::memcpy(&bits, &v, sizeof(bits));
        b = static_cast<uint16_t>(bits >> 16);  // exact: every e4m3 magnitude fits bf16's mantissa
      }
      t.lo[i] = static_cast<uint8_t>(b & 0xff);
      t.hi[i] = static_cast<uint8_t>(b >> 8);
    }
    return t;
  }();
  return table;
}

E4m3Tables e4m3_tables() {
  const E4m3TableBytes& t = e4m3_table_bytes();
  return {_mm512_load_si512(t.lo), _mm512_load_si512(t.lo + 64), _mm512_load_si512(t.hi),
          _mm512_load_si512(t.hi + 64)};
}

// x [M, K] bf16 -> [M, K_pad] bf16 in the order the unpacked weights come in: per 64-input chunk,
// unpacklo holds inputs 16j + 0..7 and unpackhi 16j + 8..15 of each 128-bit lane j (zeros past K).
std::vector<uint16_t> x_table_layout(const uint16_t* xs, int64_t M, int64_t K, int64_t K_pad) {
  std::vector<uint16_t> out(static_cast<size_t>(M * K_pad), 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K_pad; c += kChunk)
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t j = 0; j < 4; ++j)
          for (int64_t i = 0; i < 8; ++i) {
            const int64_t k = c + 16 * j + 8 * half + i;
            if (k < K) out[m * K_pad + c + 32 * half + 8 * j + i] = xs[m * K + k];
          }
  return out;
}

__attribute__((target("avx512vbmi"))) inline void widen_chunk(const E4m3Tables& t, __m512i raw, __m512bh* lo,
                                                              __m512bh* hi) {
  const __m512i lo_bytes = _mm512_permutex2var_epi8(t.lo0, raw, t.lo1);
  // hi | (raw & 0x80): vpternlogd with A = hi, B = raw, C = 0x80 -> A | (B & C) = 0xf8.
  const __m512i hi_bytes =
      _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, raw, t.hi1), raw, _mm512_set1_epi8(-128), 0xf8);
  *lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(lo_bytes, hi_bytes));
  *hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(lo_bytes, hi_bytes));
}

// Weight rows rows[0 .. R - 1] against M activation rows (laid out by x_table_layout): per K
// block, R x M accumulators of vdpbf16ps over the block's chunks, folded into the row's totals by
// the block's scale. `block` is a multiple of kChunk, or K itself (one scale per row); the last
// chunk of K is read under a byte mask (a zero byte widens to +0).
template <int64_t R, int64_t M>
__attribute__((target("avx512vbmi"))) void rows_dot_table(const E4m3Tables& t, const uint8_t* qs, const float* ss,
                                                          const uint16_t* xp, const int64_t* rows, int64_t K,
                                                          int64_t K_pad, int64_t KB, int64_t block,
                                                          float* out /* [M, R] */) {
  __m512 total[R][M];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) total[r][m] = _mm512_setzero_ps();
  const int64_t K_full = K / kChunk * kChunk;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k0 = kb * block, k1 = std::min(K_pad, k0 + block);
    __m512 acc[R][M];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += kChunk) {
      const __mmask64 live = k < K_full ? ~__mmask64{0} : (__mmask64{1} << (K - k)) - 1;
      for (int64_t r = 0; r < R; ++r) {
        const uint8_t* w = qs + rows[r] * K + k;
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchAhead), _MM_HINT_T0);
        __m512bh lo, hi;
        widen_chunk(t, k < K_full ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8(live, w), &lo, &hi);
        for (int64_t m = 0; m < M; ++m) {
          const uint16_t* x = xp + m * K_pad + k;
          acc[r][m] = _mm512_dpbf16_ps(acc[r][m], lo, reinterpret_cast<__m512bh>(_mm512_loadu_si512(x)));
          acc[r][m] = _mm512_dpbf16_ps(acc[r][m], hi, reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + 32)));
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m512 sv = _mm512_set1_ps(ss[rows[r] * KB + kb]);
      for (int64_t m = 0; m < M; ++m) total[r][m] = _mm512_fmadd_ps(acc[r][m], sv, total[r][m]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < M; ++m) out[m * R + r] = _mm512_reduce_add_ps(total[r][m]);
}

// Rows n0 .. n1 - 1 of one thread, as S streams: the range cut into S runs of consecutive rows,
// one row of each run per pass. Each run is one sequential stream of bytes (rows are stored one
// after the other), which Intel's L2 streamer follows on its own (simd.h kTileStreams); S rows
// next to each other would be one stream read out of order.
template <int64_t M>
__attribute__((target("avx512vbmi"))) void gemv_rows_table(const uint8_t* qs, const float* ss, const uint16_t* xp,
                                                           const float* bs, float* ys, int64_t n0, int64_t n1,
                                                           int64_t N, int64_t K, int64_t K_pad, int64_t KB,
                                                           int64_t block) {
  const E4m3Tables t = e4m3_tables();
  constexpr int64_t S = kvflow::kTileStreams(M);
  const int64_t run = (n1 - n0) / S;
  float out[M * S];
  int64_t rows[S];
  auto store = [&](int64_t count) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < count; ++r)
        ys[m * N + rows[r]] = out[m * count + r] + (bs != nullptr ? bs[rows[r]] : 0.0f);
  };
  for (int64_t i = 0; i < run; ++i) {
    for (int64_t s = 0; s < S; ++s) rows[s] = n0 + s * run + i;
    rows_dot_table<S, M>(t, qs, ss, xp, rows, K, K_pad, KB, block, out);
    store(S);
  }
  for (int64_t n = n0 + S * run; n < n1; ++n) {
    rows[0] = n;
    rows_dot_table<1, M>(t, qs, ss, xp, rows, K, K_pad, KB, block, out);
    store(1);
  }
}

// The table form runs where the CPU has VBMI and every scale block is whole chunks (or one block
// spans K); otherwise the bit-manipulation form.
bool table_form_applies(int64_t K, int64_t block) {
  static const bool has_vbmi = __builtin_cpu_supports("avx512vbmi");
  return has_vbmi && (block % kChunk == 0 || block >= K);
}
#endif

}  // namespace

// x: [M, K] bf16; q: [N, K] uint8 (e4m3 bytes); scale: [N, KB] fp32 with KB = ceil(K / block);
// bias: optional [N] -> [M, N] bf16.
at::Tensor skinny_linear_fp8(at::Tensor x, at::Tensor q, at::Tensor scale, int64_t block,
                                c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dtype() == at::kBFloat16 && x.dim() == 2 && x.size(0) <= kMaxRows, "bf16 x [M <= 8, K] expected");
  TORCH_CHECK(q.dtype() == at::kByte && q.dim() == 2 && q.size(1) == x.size(1), "uint8 q [N, K] expected");
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  const int64_t KB = (K + block - 1) / block;
  TORCH_CHECK(block > 0 && scale.dtype() == at::kFloat && scale.size(0) == N && scale.size(1) == KB,
              "fp32 scale [N, ceil(K / block)] expected");
  q = q.contiguous();
  scale = scale.contiguous();
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  auto out = kvflow::empty({M, N}, at::kFloat);
  const uint8_t* qs = q.data_ptr<uint8_t>();
  const float* ss = scale.data_ptr<float>();
  const float* bs = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  float* ys = out.data_ptr<float>();
  // Grain: a thread streams >= ~64 KiB of weights between synchronisations.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, K));
#if defined(__AVX512F__)
  if (table_form_applies(K, block)) {
    const int64_t K_pad = (K + kChunk - 1) / kChunk * kChunk;
    const at::Tensor xb = x.contiguous();  // the bf16 activations as they are: no fp32 round trip
    const std::vector<uint16_t> xp =
        x_table_layout(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), M, K, K_pad);
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      const uint16_t* x = xp.data();
      switch (M) {
        case 1: gemv_rows_table<1>(qs, ss, x, bs, ys, n0, n1, N, K, K_pad, KB, block); break;
        case 2: gemv_rows_table<2>(qs, ss, x, bs, ys, n0, n1, N, K, K_pad, KB, block); break;
        case 3: gemv_rows_table<3>(qs, ss, x, bs, ys, n0, n1, N, K, K_pad, KB, block); break;
        case 4: gemv_rows_table<4>(qs, ss, x, bs, ys, n0, n1, N, K, K_pad, KB, block); break;
        case 5: gemv_rows_table<5>(qs, ss, x, bs, ys, n0, n1, N, K, K_pad, KB, block); break;
        case 6: gemv_rows_table<6>(qs, ss, x, bs, ys, n0, n1, N, K, K_pad, KB, block); break;
        case 7: gemv_rows_table<7>(qs, ss, x, bs, ys, n0, n1, N, K, K_pad, KB, block); break;
        default: gemv_rows_table<8>(qs, ss, x, bs, ys, n0, n1, N, K, K_pad, KB, block); break;
      }
    });
    return out.to(at::kBFloat16);
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xs = xf.data_ptr<float>();
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
  return out.to(at::kBFloat16);
}
