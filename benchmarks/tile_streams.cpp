// How fast one or two cores stream a bf16 GEMV's weight tiles, by how many tiles a thread reads
// side by side (gemv_bf16.cpp / gemv_int8.cpp, simd.h kTileStreams) and by software prefetch.
// Standalone (no torch), AVX-512 BF16, so it isolates the memory system from kvflow:
//
//   g++ -O3 -march=native -fopenmp benchmarks/tile_streams.cpp -o /tmp/tile_streams && /tmp/tile_streams [MiB]
//
// The loop is the bf16 tile GEMV's at one activation row: per 64-byte line (16 rows x 2 inputs)
// one vdpbf16ps, two accumulator chains per tile, every line prefetched kAhead bytes ahead. S
// adjacent tiles of 28 KiB (16 rows at K = 896) are read side by side, then the next S. "sum" is a
// plain fp32 sum over the same bytes (what benchmarks' read-bandwidth probe does, in torch). One
// pass over MiB (default 1024: more than the L3 a VM gets) split between the threads; median and
// best of 5. Measured on an AMX Xeon VM in benchmarks/NOTES.md (session 16): one stream left a
// third of the bandwidth unused, four streams read more than the sum.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr size_t kLine = 64;
constexpr size_t kTile = 28672;  // one 16-row bf16 tile at K = 896

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <size_t kAhead, int S>
__attribute__((noinline)) __m512 tiles_loop(const uint8_t* w, size_t bytes, const uint16_t* x) {
  __m512 acc[2 * S];
  for (int s = 0; s < 2 * S; ++s) acc[s] = _mm512_setzero_ps();
  for (size_t g = 0; g + S * kTile <= bytes; g += S * kTile) {
    for (size_t b = 0; b < kTile; b += 2 * kLine) {
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        const uint8_t* p = w + g + s * kTile + b;
        if (kAhead) {
          _mm_prefetch(reinterpret_cast<const char*>(p) + kAhead, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(p) + kAhead + kLine, _MM_HINT_T0);
        }
        int32_t x0, x1;
        std::memcpy(&x0, x + ((b >> 5) & 1023), 4);
        std::memcpy(&x1, x + ((b >> 5) & 1023) + 2, 4);
        acc[2 * s] = _mm512_dpbf16_ps(acc[2 * s], (__m512bh)_mm512_loadu_si512(p), (__m512bh)_mm512_set1_epi32(x0));
        acc[2 * s + 1] =
            _mm512_dpbf16_ps(acc[2 * s + 1], (__m512bh)_mm512_loadu_si512(p + kLine), (__m512bh)_mm512_set1_epi32(x1));
      }
    }
  }
  __m512 r = acc[0];
  for (int s = 1; s < 2 * S; ++s) r = _mm512_add_ps(r, acc[s]);
  return r;
}

__attribute__((noinline)) __m512 sum_loop(const uint8_t* w, size_t bytes, const uint16_t*) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (size_t b = 0; b + 4 * kLine <= bytes; b += 4 * kLine)
    for (int i = 0; i < 4; ++i) a[i] = _mm512_add_ps(a[i], _mm512_loadu_ps(reinterpret_cast<const float*>(w + b + kLine * i)));
  return _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
}

using Loop = __m512 (*)(const uint8_t*, size_t, const uint16_t*);

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = size_t(argc > 1 ? std::atoi(argv[1]) : 1024) << 20, slack = 65536;  // slack: prefetches past the end
  auto* w = static_cast<uint8_t*>(std::aligned_alloc(size_t(2) << 20, bytes + slack));
  std::memset(w, 1, bytes + slack);
  std::vector<uint16_t> x(2048, 0x3f80);  // bf16 1.0
  const struct {
    const char* name;
    Loop loop;
  } loops[] = {
      {"sum", sum_loop},
      {"1 tile, no prefetch", tiles_loop<0, 1>},
      {"1 tile, 4 KiB ahead", tiles_loop<4096, 1>},
      {"2 tiles, no prefetch", tiles_loop<0, 2>},
      {"2 tiles, 1 KiB ahead", tiles_loop<1024, 2>},
      {"2 tiles, 4 KiB ahead", tiles_loop<4096, 2>},
      {"4 tiles, no prefetch", tiles_loop<0, 4>},
      {"4 tiles, 1 KiB ahead", tiles_loop<1024, 4>},
      {"4 tiles, 4 KiB ahead", tiles_loop<4096, 4>},
      {"8 tiles, 4 KiB ahead", tiles_loop<4096, 8>},
  };
  volatile float sink = 0;
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const auto& v : loops) {
      std::vector<double> seconds;
      for (int rep = 0; rep < 5; ++rep) {
        const double start = now();
#pragma omp parallel
        {
          const size_t chunk = bytes / size_t(omp_get_num_threads());
          sink = sink + _mm512_reduce_add_ps(v.loop(w + size_t(omp_get_thread_num()) * chunk, chunk, x.data()));
        }
        seconds.push_back(now() - start);
      }
      std::sort(seconds.begin(), seconds.end());
      std::printf("threads=%d %-22s median %6.1f GB/s   best %6.1f GB/s\n", threads, v.name,
                  double(bytes) / seconds[2] / 1e9, double(bytes) / seconds[0] / 1e9);
    }
  }
  std::free(w);
}
