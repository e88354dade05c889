// A count 1..8 as a compile-time constant, so that the per-count accumulators are register arrays:
// the tile GEMVs' activation rows per pass (gemv_bf16.cpp, gemv_int8.cpp, gemv_int4.cpp) and the
// query heads of one decode attention score pass (paged_decode_attention.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace kvflow {

template <int64_t MB>
using RowCount = std::integral_constant<int64_t, MB>;

// f(RowCount<mb>{}) for mb in 1..7; 8 for anything larger.
template <typename F>
inline void with_row_count(int64_t mb, F&& f) {
  switch (mb) {
    case 1: f(RowCount<1>{}); break;
    case 2: f(RowCount<2>{}); break;
    case 3: f(RowCount<3>{}); break;
    case 4: f(RowCount<4>{}); break;
    case 5: f(RowCount<5>{}); break;
    case 6: f(RowCount<6>{}); break;
    case 7: f(RowCount<7>{}); break;
    default: f(RowCount<8>{}); break;
  }
}

// The tile GEMVs' walk over their tiles [t_begin, t_end) for M activation rows, kMaxRows per pass:
// run(RowCount<MB>{}, RowCount<S>{}, t, m0) computes rows [m0, m0 + MB) of tiles [t, t + S), whose
// weight streams it reads side by side, S = Streams(MB) (simd.h kTileStreams), and the tiles left
// over one at a time. Groups are as wide as the first pass streams (later passes have no more rows,
// so as many streams or more fit them); every pass runs over a group while it is in L1/L2.
template <int64_t (*Streams)(int64_t), int64_t kMaxRows, typename Run>
inline void for_tile_groups(int64_t t_begin, int64_t t_end, int64_t M, const Run& run) {
  const int64_t group = Streams(std::min(M, kMaxRows));
  for (int64_t t = t_begin; t < t_end; t += group) {
    const int64_t count = std::min(group, t_end - t);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      with_row_count(std::min(kMaxRows, M - m0), [&](auto rows) {
        constexpr int64_t MB = decltype(rows)::value;
        if constexpr (MB <= kMaxRows) {
          constexpr int64_t S = Streams(MB);
          int64_t s0 = 0;
          for (; s0 + S <= count; s0 += S) run(rows, RowCount<S>{}, t + s0, m0);
          for (; s0 < count; ++s0) run(rows, RowCount<1>{}, t + s0, m0);
        }
      });
    }
  }
}

}  // namespace kvflow
