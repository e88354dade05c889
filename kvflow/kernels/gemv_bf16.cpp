// Skinny bf16 matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), passes of <= 8 rows.
//
// Why: decode reads every weight once per step, so it is bound by memory bandwidth at one row
// and, with a plain [N, K] layout, by compute at a few: each weight row's dot product with each
// activation row ended in a horizontal reduction, and oneDNN, which takes over at 5-8 rows, ran at
// 180 GFLOP/s (8-sequence decode at half the speed the bandwidth allows; benchmarks/NOTES.md).
//
// Layout: tiles of 16 output rows (N padded to a multiple of 16 with zero rows), the rows
// interleaved by pairs of inputs: tile t holds, for each input pair p = (2p, 2p + 1) and lane l,
//   w_tiles[t, p, l, 0..1] = W[16t + l, 2p .. 2p + 1]        ([N_pad / 16, K / 2, 16, 2] bf16)
// so one 64-byte load is 2 inputs of 16 rows, and vdpbf16ps against the 2 activations broadcast
// to every lane adds both products into lane l = output row 16t + l (fp32). No horizontal sums:
// a tile's 16 outputs come out as one register. Per 64 bytes of weights: one load and one
// vdpbf16ps per activation row. Each tile is one sequential stream (~28 KiB at K = 896); at up to
// 4 rows a thread reads 2-4 adjacent tiles side by side, so that its core keeps several streams in
// flight (simd.h kTileStreams: one stream left a third of an Intel server core's bandwidth unused).
//
// Batch invariance: output (m, n) is lane n % 16 of two accumulators (even and odd pairs) summed
// at the end, in the same order whatever M is, so a token's logits do not depend on what else is
// decoded with it (speculative verification reproduces plain decoding bit for bit). Up to 8 rows
// share one pass over the weights (registers: 2 accumulators per row); more rows take more passes
// over each tile while it is in L1/L2, so up to ~32 rows the weights still come from DRAM once
// (kvflow/layers/linear.py: past 32 rows oneDNN is faster, past 8 where it runs on AMX tiles,
// except in batch-invariant mode).
//
// The AVX2 build (no vdpbf16ps, 16 ymm registers) has its own tile over the same layout: the
// 64-byte pair row splits into two 8-row halves, each widened to fp32 by an AND (input 2p + 1) and
// a shift (input 2p). One accumulator per row and half, so 4 rows per pass: 8 accumulators, 4
// widened weights and 2 activation broadcasts fit the register file. Per pair,
// acc += (x_2p * w_2p + x_2p+1 * w_2p+1), the pair's sum computed off the accumulator's chain.
// Several rows broadcast their activations from a copy widened to fp32 once per call; one row
// broadcasts its bf16 pair and splits it like the weights (the same fp32 values, fewer loads). The
// AVX-512 tile through avx512_on_avx2.h needed 32 registers at 8 rows and spilled (head-sized
// GEMV, 8 rows, 2 threads: 9.5 GB/s of weights against 13.2 here; benchmarks/NOTES.md, session 13).
// Output (m, n) is the same chain of operations over the pairs whatever M is: batch-invariant.

#include <ATen/Parallel.h>
#include "aten_lite.h"
#include "simd.h"

#include "argmax_lanes.h"
#include "row_dispatch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

namespace {

constexpr int64_t kTileRows = 16;         // output rows per tile: one per fp32 lane
#if defined(__AVX512F__)
constexpr int64_t kMaxRows = 8;           // activation rows sharing one pass over the weights
#else
constexpr int64_t kMaxRows = 4;           // AVX2: 8 accumulators + 4 weights + 2 broadcasts of 16 ymm
#endif
// Weights prefetched ahead of the loads: kPrefetchBytes per thread, split between the tile
// streams it reads side by side (AVX-512: 4096 / S bytes ahead in each of S). Measured on an AMX
// Xeon (NOTES.md, session 16), single-stream bf16 decode steps, alternated: four streams 1 KiB
// ahead each 31.5 / 32.6 ms against 32.8 / 33.6 at 4 KiB each; one stream (8-row passes,
// 8-sequence decode) lost ~5% of its tokens/s at 1 KiB against 4.
constexpr int64_t kPrefetchBytes = 4096;

struct TiledGemv {
  const uint16_t* w;  // [N_pad / 16, K / 2, 16, 2]
  const uint16_t* x;  // [M, K]
  const float* xf;    // [M, K]: x widened to fp32 (the AVX2 tile's broadcasts at M > 1; else null)
  const float* bias;  // [N] or null
  uint16_t* y;        // [M, N]
  int64_t M, K, N;

  // Tile t's 16 columns of y: which are valid, and their bias (zero without one).
  struct Columns {
    int64_t n0;
    __mmask16 keep;
    __m512 bias;
  };
  inline Columns columns(int64_t t) const {
    const int64_t n0 = t * kTileRows, valid = std::min(kTileRows, N - n0);
    const __mmask16 keep = __mmask16((1u << valid) - 1u);
    return {n0, keep, bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps()};
  }

  // y[m, tile columns] = bf16(acc + bias), round to nearest even.
  inline void store(const Columns& c, int64_t m, __m512 acc) const {
    const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc, c.bias));
    _mm256_mask_storeu_epi16(y + m * N + c.n0, c.keep, out);
  }

#if defined(__AVX512F__)
  // Rows [m0, m0 + MB) of y for tiles t .. t + S - 1, the S tiles' weight streams read side by side
  // (simd.h kTileStreams); per tile and row the same two chains as for S = 1.
  template <int64_t MB, int64_t S>
  inline void tile(int64_t t, int64_t m0) const {
    const int64_t pairs = K / 2;
    constexpr int64_t ahead = kPrefetchBytes / S;  // bytes, in each stream
    const uint16_t* wt[S];
    __m512 even[S][MB], odd[S][MB];
    for (int64_t s = 0; s < S; ++s) {
      wt[s] = w + (t + s) * pairs * 2 * kTileRows;
      for (int64_t m = 0; m < MB; ++m) even[s][m] = odd[s][m] = _mm512_setzero_ps();
    }
    int64_t p = 0;
    for (; p + 2 <= pairs; p += 2) {  // two input pairs per iteration: one per accumulator chain
      for (int64_t s = 0; s < S; ++s) {
        const uint16_t* wp = wt[s] + p * 2 * kTileRows;
        _mm_prefetch(reinterpret_cast<const char*>(wp) + ahead, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wp) + ahead + 64, _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 2 * kTileRows);
        for (int64_t m = 0; m < MB; ++m) {
          int32_t x0, x1;  // the pair's 2 activations, broadcast to every row's lane (from L1)
          std::memcpy(&x0, x + (m0 + m) * K + 2 * p, 4);
          std::memcpy(&x1, x + (m0 + m) * K + 2 * p + 2, 4);
          even[s][m] = _mm512_dpbf16_ps(even[s][m], w0, (__m512bh)_mm512_set1_epi32(x0));
          odd[s][m] = _mm512_dpbf16_ps(odd[s][m], w1, (__m512bh)_mm512_set1_epi32(x1));
        }
      }
    }
    if (p < pairs) {  // an odd number of pairs: the last one on the even chain
      for (int64_t m = 0; m < MB; ++m) {
        int32_t x0;
        std::memcpy(&x0, x + (m0 + m) * K + 2 * p, 4);
        for (int64_t s = 0; s < S; ++s) {
          const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wt[s] + p * 2 * kTileRows);
          even[s][m] = _mm512_dpbf16_ps(even[s][m], w0, (__m512bh)_mm512_set1_epi32(x0));
        }
      }
    }
    for (int64_t s = 0; s < S; ++s) {
      const Columns c = columns(t + s);
      for (int64_t m = 0; m < MB; ++m) store(c, m0 + m, _mm512_add_ps(even[s][m], odd[s][m]));
    }
  }

#else
  // Rows [m0, m0 + MB) of y for tile t, MB <= 4 (the AVX2 tile in the header comment); one tile at
  // a time (S = 1: 16 registers leave no room for a second stream).
  template <int64_t MB, int64_t S>
  inline void tile(int64_t t, int64_t m0) const {
    static_assert(S == 1, "the AVX2 tile reads one stream");
    const int64_t pairs = K / 2;
    const uint16_t* wt = w + t * pairs * 2 * kTileRows;
    const __m256i top = _mm256_set1_epi32(int(0xffff0000u));  // a bf16 pair's upper half: input 2p + 1
    __m256 lo[MB], hi[MB];  // rows 16t + 0..7 and 16t + 8..15 of activation row m0 + m
    const float* xs[MB];    // activation row m0 + m, from input 2p
    for (int64_t m = 0; m < MB; ++m) {
      lo[m] = hi[m] = _mm256_setzero_ps();
      xs[m] = xf + (m0 + m) * K;
    }
    for (int64_t p = 0; p < pairs; ++p) {
      const uint16_t* wp = wt + p * 2 * kTileRows;  // one 64-byte line: 16 rows x inputs 2p, 2p + 1
      _mm_prefetch(reinterpret_cast<const char*>(wp) + kPrefetchBytes, _MM_HINT_T0);
      __m256i w_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
      __m256i w_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + kTileRows));
      // Into registers once: GCC otherwise folds each load into the AND as well as issuing it for
      // the shift, two load uops per weight vector, and a core streaming from DRAM keeps fewer
      // bytes in flight (one row read ~13% slower).
      __asm__("" : "+x"(w_lo), "+x"(w_hi));
      const __m256 odd_lo = _mm256_castsi256_ps(_mm256_and_si256(w_lo, top));
      const __m256 odd_hi = _mm256_castsi256_ps(_mm256_and_si256(w_hi, top));
      const __m256 even_lo = _mm256_castsi256_ps(_mm256_slli_epi32(w_lo, 16));
      const __m256 even_hi = _mm256_castsi256_ps(_mm256_slli_epi32(w_hi, 16));
      for (int64_t m = 0; m < MB; ++m) {
        __m256 x_odd, x_even;  // activations 2p + 1 and 2p, broadcast (the same values either way)
        if constexpr (MB == 1) {  // one load: the bf16 pair, split like the weights
          int32_t pair;
          std::memcpy(&pair, x + (m0 + m) * K + 2 * p, 4);
          const __m256i xp = _mm256_set1_epi32(pair);
          x_odd = _mm256_castsi256_ps(_mm256_and_si256(xp, top));
          x_even = _mm256_castsi256_ps(_mm256_slli_epi32(xp, 16));
        } else {  // loads, not ALU work: at 4 rows the vector ALUs are the busy ports
          x_odd = _mm256_broadcast_ss(xs[m] + 2 * p + 1);
          x_even = _mm256_broadcast_ss(xs[m] + 2 * p);
        }
        // The pair's two products summed off the accumulator's chain (exact product, one FMA),
        // so the chain is one add per pair: one row is not FMA-latency-bound (a chain of two FMAs
        // per pair read 24 GB/s on one core from L2, this form 46, the AVX-512 tile's form 46).
        lo[m] = _mm256_add_ps(lo[m], _mm256_fmadd_ps(even_lo, x_even, _mm256_mul_ps(odd_lo, x_odd)));
        hi[m] = _mm256_add_ps(hi[m], _mm256_fmadd_ps(even_hi, x_even, _mm256_mul_ps(odd_hi, x_odd)));
      }
    }
    const Columns c = columns(t);
#pragma GCC unroll 4  // whole: a loop indexing lo / hi at run time keeps them in memory inside the one above
    for (int64_t m = 0; m < MB; ++m) store(c, m0 + m, __m512{lo[m], hi[m]});
  }
#endif

  void tiles(int64_t t_begin, int64_t t_end) const {
    kvflow::for_tile_groups<kvflow::kTileStreams, kMaxRows>(
        t_begin, t_end, M, [&](auto rows, auto streams, int64_t t, int64_t m0) {
          tile<decltype(rows)::value, decltype(streams)::value>(t, m0);
        });
  }
};

}  // namespace

// W [N, K] bf16 -> its tiles [N_pad / 16, K / 2, 16, 2] (the layout above; padding rows zero).
at::Tensor tile_bf16_weight(at::Tensor w) {
  TORCH_CHECK(w.dtype() == at::kBFloat16 && w.dim() == 2 && w.size(1) % 2 == 0, "bf16 [N, K] with K even");
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + kTileRows - 1) / kTileRows;
  auto padded = kvflow::zeros({tiles * kTileRows, K}, w.options());
  padded.slice(0, 0, N).copy_(w);
  // [t, l, p, 2] -> [t, p, l, 2]
  return padded.view({tiles, kTileRows, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

// skinny_linear_bf16; with `tokens` (non-null, [M]), also each row's argmax (argmax_lanes.h).
at::Tensor skinny_linear_bf16_impl(at::Tensor x, const at::Tensor& w_tiles, int64_t out_features,
                                      const c10::optional<at::Tensor>& bias, int64_t* tokens) {
  TORCH_CHECK(x.dtype() == at::kBFloat16 && w_tiles.dtype() == at::kBFloat16, "bf16 inputs expected");
  TORCH_CHECK(w_tiles.dim() == 4 && w_tiles.size(2) == kTileRows && w_tiles.size(3) == 2 && w_tiles.is_contiguous(),
              "weights must be tiles [N_pad / 16, K / 2, 16, 2] (tile_bf16_weight)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * w_tiles.size(1), "x must be [M, K]");
  const int64_t tiles = w_tiles.size(0);
  TORCH_CHECK(0 < out_features && out_features <= tiles * kTileRows && out_features > (tiles - 1) * kTileRows,
              "out_features does not match the tiles");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  auto y = kvflow::empty({M, N}, x.options());
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  // The AVX2 tile's broadcasts at several rows (exact); one row and the AVX-512 tile read x itself.
  at::Tensor x_f32;
#if !defined(__AVX512F__)
  if (M > 1) x_f32 = x.to(at::kFloat);
#endif
  const float* xf = x_f32.defined() ? x_f32.data_ptr<float>() : nullptr;
  const TiledGemv gemv{reinterpret_cast<const uint16_t*>(w_tiles.data_ptr<at::BFloat16>()),
                       reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                       xf,
                       bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
                       reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                       M, K, N};
  if (M == 0) return y;
  // Grain: a thread streams >= ~64 KiB of weights between synchronisations.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (K * 2 * kTileRows));
  kvflow::parallel_tiles(tiles, grain, gemv.y, M, N, tokens,
                         [&](int64_t begin, int64_t end) { gemv.tiles(begin, end); });
  return y;
}

}  // namespace

// x: [M, K] bf16, w_tiles: tile_bf16_weight(W), N = out_features, bias: optional [N] (any float
// dtype) -> [M, N] bf16.
at::Tensor skinny_linear_bf16(at::Tensor x, at::Tensor w_tiles, int64_t out_features,
                                 c10::optional<at::Tensor> bias) {
  return skinny_linear_bf16_impl(std::move(x), w_tiles, out_features, bias, nullptr);
}

at::Tensor skinny_linear_bf16_greedy(at::Tensor x, at::Tensor w_tiles, int64_t out_features,
                                        c10::optional<at::Tensor> bias) {
  auto tokens = kvflow::empty({x.size(0)}, at::kLong);
  skinny_linear_bf16_impl(std::move(x), w_tiles, out_features, bias, tokens.data_ptr<int64_t>());
  return tokens;
}
