// How fast one or two cores stream a weight matrix through the int8 GEMV's AVX2 inner loop, by
// software prefetch pattern: none, every other 64-byte line (what the AVX-512 build does, leaning
// on the adjacent-line prefetcher), every line at 1, 4 and 8 KiB ahead. Plus a plain read and the
// bf16 inner loop for scale. Standalone (no torch), so it isolates the memory system from kvflow:
//
//   g++ -O3 -mavx2 -mfma -fopenmp benchmarks/weight_stream.cpp -o /tmp/weight_stream && /tmp/weight_stream
//
// "DRAM": one pass over 256 MiB split between the threads; "hot": 1 MiB per thread 64 times (L2 +
// L3), i.e. the loop's compute rate. Best of 5. Measured on a Zen 3 in benchmarks/NOTES.md
// (session 13): every other line was slower than no software prefetch at all.
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

constexpr size_t kBlockBytes = 512;  // the int8 GEMV's block: 16 rows x 32 inputs
constexpr size_t kLine = 64;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The int8 GEMV's AVX2 inner loop at one activation row (gemv_int8.cpp with avx512_on_avx2.h):
// per 64 bytes, the signed weights' |q| times sign-moved activations (vpmaddubsw), summed to int32;
// per block, one fp32 scale FMA. Prefetch: kPrefetchAhead bytes ahead, every kStride bytes.
template <size_t kPrefetchAhead, size_t kStride>
__attribute__((noinline)) __m256i int8_loop(const uint8_t* w, size_t bytes, const int8_t* x) {
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  size_t xi = 0;
  for (size_t b = 0; b < bytes; b += kBlockBytes) {
    if (kPrefetchAhead)
      for (size_t l = 0; l < kBlockBytes; l += kStride)
        _mm_prefetch(reinterpret_cast<const char*>(w) + b + kPrefetchAhead + l, _MM_HINT_T0);
    __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
    for (size_t c = 0; c < kBlockBytes / kLine; ++c) {
      const __m256i lo = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b + kLine * c)), flip);
      const __m256i hi =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b + kLine * c + 32)), flip);
      int32_t x4;
      std::memcpy(&x4, x + ((xi + 4 * c) & 1023), 4);
      const __m256i xb = _mm256_set1_epi32(x4);
      d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(xb, lo)), ones));
      d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(xb, hi)), ones));
    }
    xi += 32;
    const __m256 s = _mm256_set1_ps(1.0f + float(xi & 7));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), s, acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), s, acc1);
  }
  return _mm256_castps_si256(_mm256_add_ps(acc0, acc1));
}

// The bf16 GEMV's AVX2 inner loop at one row: per 64-byte line (16 rows x 2 inputs), two 8-row
// halves widened by a mask and a shift, 4 FMAs; every line prefetched 4 KiB ahead.
__attribute__((noinline)) __m256i bf16_loop(const uint8_t* w, size_t bytes, const int8_t* x) {
  const __m256i top = _mm256_set1_epi32(int(0xffff0000u));
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (size_t b = 0; b < bytes; b += kLine) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + b + 4096, _MM_HINT_T0);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b + 32));
    const __m256 xo = _mm256_set1_ps(float(x[(b >> 6) & 1023])), xe = _mm256_set1_ps(float(x[(b >> 5) & 1023]));
    lo = _mm256_add_ps(lo, _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), xe,
                                           _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(w0, top)), xo)));
    hi = _mm256_add_ps(hi, _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), xe,
                                           _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(w1, top)), xo)));
  }
  return _mm256_castps_si256(_mm256_add_ps(lo, hi));
}

__attribute__((noinline)) __m256i read_loop(const uint8_t* w, size_t bytes, const int8_t*) {
  __m256i a = _mm256_setzero_si256(), b2 = a;
  for (size_t b = 0; b < bytes; b += kLine) {
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b)));
    b2 = _mm256_xor_si256(b2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b + 32)));
  }
  return _mm256_xor_si256(a, b2);
}

using Loop = __m256i (*)(const uint8_t*, size_t, const int8_t*);

}  // namespace

int main() {
  const size_t bytes = size_t(256) << 20, hot = size_t(1) << 20, slack = 16384;  // slack: prefetches past the end
  auto* w = static_cast<uint8_t*>(std::aligned_alloc(64, bytes + slack));
  for (size_t i = 0; i < bytes + slack; ++i) w[i] = uint8_t((i * 2654435761u) >> 24);
  std::vector<int8_t> x(1024 + 64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = int8_t(int(i * 37 % 255) - 127);
  const struct {
    const char* name;
    Loop loop;
  } loops[] = {
      {"read", read_loop},
      {"int8, no prefetch", int8_loop<0, kLine>},
      {"int8, every 2nd line 4K", int8_loop<4096, 2 * kLine>},
      {"int8, every line 1K", int8_loop<1024, kLine>},
      {"int8, every line 4K", int8_loop<4096, kLine>},
      {"int8, every line 8K", int8_loop<8192, kLine>},
      {"bf16, every line 4K", bf16_loop},
  };
  volatile int sink = 0;
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const auto& v : loops) {
      double dram = 1e9, cached = 1e9;
      for (int rep = 0; rep < 5; ++rep) {
        double start = now();
#pragma omp parallel
        {
          const size_t chunk = bytes / size_t(omp_get_num_threads());
          sink = sink + _mm256_extract_epi32(v.loop(w + size_t(omp_get_thread_num()) * chunk, chunk, x.data()), 0);
        }
        dram = std::min(dram, now() - start);
        start = now();
#pragma omp parallel
        {
          for (int i = 0; i < 64; ++i)
            sink = sink + _mm256_extract_epi32(v.loop(w + size_t(omp_get_thread_num()) * hot, hot, x.data()), 0);
        }
        cached = std::min(cached, now() - start);
      }
      std::printf("threads=%d %-26s DRAM %6.1f GB/s   hot %6.1f GB/s\n", threads, v.name, double(bytes) / dram / 1e9,
                  threads * 64.0 * double(hot) / cached / 1e9);
    }
  }
  std::free(w);
}
