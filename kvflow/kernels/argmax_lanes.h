// Argmax over columns, vectorised: each of 16 lanes keeps its maximum and the first column that
// reached it, so one pass gives the maximum and its first index (torch.argmax's answer: a NaN
// counts as the maximum, the first NaN's index). Shared by the greedy argmax over logits
// (argmax.cpp) and the GEMVs' greedy epilogue (parallel_tiles_greedy below), which folds a row's
// outputs into its argmax every few tiles while the LM head writes them, instead of reading 300 KB
// of logits per row back from DRAM afterwards (the head's 272 MB weight stream has evicted them).
#pragma once

#include <ATen/Parallel.h>
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "bf16_utils.h"

namespace kvflow {

// The best of a column span: its maximum, the first index holding it; `nan`: a NaN was seen, and
// `index` is then the first NaN's.
struct SpanBest {
  float value;
  int64_t index;
  bool nan;
};

// a, then b (b's columns after a's): the best of both.
inline SpanBest combine(const SpanBest& a, const SpanBest& b) {
  if (a.nan) return a;
  if (b.nan || b.value > a.value) return b;
  return a;  // equal: the earlier index
}

// Per lane: the maximum so far and the first column reaching it (valid once it rose above -inf).
struct LaneBest {
  __m512 value = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i index = _mm512_setzero_si512();
  __mmask16 nan = 0;

  // x: columns col0 .. col0 + 15 (lanes outside `valid` ignored).
  inline void update(__m512 x, int64_t col0, __mmask16 valid) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    nan |= _mm512_mask_cmp_ps_mask(valid, x, x, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, x, value, _CMP_GT_OQ);  // strictly: first index stays
    value = _mm512_mask_mov_ps(value, gt, x);
    index = _mm512_mask_mov_epi32(index, gt, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(col0))));
  }

  // The span [begin, end) these lanes saw; `load(v)` reads column v as fp32 (only for a NaN, rare).
  template <typename Load>
  SpanBest result(int64_t begin, int64_t end, const Load& load) const {
    if (nan) {
      for (int64_t v = begin; v < end; ++v)
        if (std::isnan(load(v))) return {0.0f, v, true};
    }
    const float best = _mm512_reduce_max_ps(value);
    if (best == -std::numeric_limits<float>::infinity()) return {best, begin, false};  // all -inf: the first
    const __mmask16 at_best = _mm512_cmp_ps_mask(value, _mm512_set1_ps(best), _CMP_EQ_OQ);
    return {best, _mm512_mask_reduce_min_epi32(at_best, index), false};
  }
};

// Output tiles (16 columns each) a thread runs between two folds of their outputs into the rows'
// argmax: per fold one pass over each row's new columns with its lanes in registers, reading them
// from L1/L2 (16 tiles x 8 rows: 4 KB). Folding after every tile cost the 8-row LM head 0.4-0.8
// ms at ~80 GB/s (3.8-4.4 -> 4.7-4.9 ms, head alone, alternated), where that GEMV is nearly
// compute-bound: per tile and row the lanes went through memory and the just-stored outputs were
// reloaded through a masked store-to-load forward.
constexpr int64_t kTilesPerFold = 16;

// Runs run_tiles over [0, tiles) as at::parallel_for(0, tiles, grain, ...) would, and folds each
// thread's outputs y[m, 16t .. 16t + 16) into row m's running argmax every kTilesPerFold tiles,
// while they are still in cache; tokens[m] = the argmax of row m of y [M, N] over all its columns,
// as argmax_rows(y) gives.
template <typename RunTiles>
void parallel_tiles_greedy(int64_t tiles, int64_t grain, const uint16_t* y, int64_t M, int64_t N, int64_t* tokens,
                           const RunTiles& run_tiles) {
  constexpr int64_t kTileCols = 16;
  if (M == 0) {
    at::parallel_for(0, tiles, grain, run_tiles);
    return;
  }
  std::mutex mutex;
  std::vector<std::pair<int64_t, std::vector<SpanBest>>> spans;  // (first tile, each row's best), per chunk
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<LaneBest> lanes(M);
    for (int64_t t0 = begin; t0 < end; t0 += kTilesPerFold) {
      const int64_t t1 = std::min(end, t0 + kTilesPerFold);
      run_tiles(t0, t1);
      const int64_t c1 = std::min(N, t1 * kTileCols);
      for (int64_t m = 0; m < M; ++m) {
        LaneBest lane = lanes[m];
        for (int64_t n0 = t0 * kTileCols; n0 < c1; n0 += kTileCols) {
          const __mmask16 valid = lanes_left(c1 - n0);
          lane.update(load_bf16_lanes(y + m * N + n0, valid), n0, valid);
        }
        lanes[m] = lane;
      }
    }
    std::vector<SpanBest> best(M);
    const int64_t c0 = begin * kTileCols, c1 = std::min(N, end * kTileCols);
    for (int64_t m = 0; m < M; ++m)
      best[m] = lanes[m].result(c0, c1, [&](int64_t v) { return bf16_to_float(y[m * N + v]); });
    const std::lock_guard<std::mutex> lock(mutex);
    spans.emplace_back(begin, std::move(best));
  });
  std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (int64_t m = 0; m < M; ++m) {
    SpanBest b = spans[0].second[m];
    for (size_t s = 1; s < spans.size(); ++s) b = combine(b, spans[s].second[m]);
    tokens[m] = b.index;
  }
}

// run_tiles over [0, tiles) as at::parallel_for(0, tiles, grain, run_tiles) does; with `tokens`
// (non-null, [M]), also each row's argmax of y [M, N] (parallel_tiles_greedy). The GEMVs' one
// entry for both their plain and their greedy form.
template <typename RunTiles>
void parallel_tiles(int64_t tiles, int64_t grain, const uint16_t* y, int64_t M, int64_t N, int64_t* tokens,
                    const RunTiles& run_tiles) {
  if (tokens == nullptr) return at::parallel_for(0, tiles, grain, run_tiles);
  parallel_tiles_greedy(tiles, grain, y, M, N, tokens, run_tiles);
}

}  // namespace kvflow
