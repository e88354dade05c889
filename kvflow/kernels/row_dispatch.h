// A count 1..8 as a compile-time constant, so that the per-count accumulators are register arrays:
// the tile GEMVs' activation rows per pass (gemv_bf16.cpp, gemv_int8.cpp, gemv_int4.cpp) and the
// query heads of one decode attention score pass (paged_decode_attention.cpp).
#pragma once

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

}  // namespace kvflow
