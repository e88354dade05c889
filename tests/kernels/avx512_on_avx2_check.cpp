// Checks kvflow/kernels/avx512_on_avx2.h against scalar definitions of the AVX-512 instructions it
// stands in for (Intel's pseudo-code), on random and edge-case inputs. Built with AVX2 flags only
// (tests/kernels/test_avx512_on_avx2.py), so it runs on AVX2 and AVX-512 CPUs alike. Prints each
// failed check and exits 1 if any failed.
#include "simd.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>

#if defined(__AVX512F__)
#error "build this check without -mavx512f: it tests the AVX2 stand-ins"
#endif

namespace {

int failures = 0;
std::mt19937 rng(1234);

void check(bool ok, const char* what, int lane) {
  if (!ok && failures++ < 50) std::printf("FAIL %s (lane %d)\n", what, lane);
}

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
bool same_bits(float a, float b) { return bits_of(a) == bits_of(b); }

// vcvtneps2bf16 on one value: denormals to signed zero, NaN quiet, round to nearest even.
uint16_t ref_bf16(float f) {
  uint32_t b = bits_of(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40u);
  if ((b & 0x7f800000u) == 0) return uint16_t((b & 0x80000000u) >> 16);
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

float random_float() { return std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng); }
uint16_t random_bf16() { return uint16_t(bits_of(random_float()) >> 16); }

void check_dot_products() {
  for (int trial = 0; trial < 200; ++trial) {
    alignas(64) uint16_t a[32], b[32];
    alignas(64) float acc[16], out[16];
    for (int i = 0; i < 32; ++i) a[i] = random_bf16(), b[i] = random_bf16();
    for (float& v : acc) v = random_float();
    _mm512_storeu_ps(out, _mm512_dpbf16_ps(_mm512_loadu_ps(acc), (__m512bh)_mm512_loadu_si512(a),
                                           (__m512bh)_mm512_loadu_si512(b)));
    for (int l = 0; l < 16; ++l) {  // odd product first, then even; bf16 products are exact in fp32
      float r = acc[l];
      r = std::fma(float_of(uint32_t(a[2 * l + 1]) << 16), float_of(uint32_t(b[2 * l + 1]) << 16), r);
      r = std::fma(float_of(uint32_t(a[2 * l]) << 16), float_of(uint32_t(b[2 * l]) << 16), r);
      check(same_bits(out[l], r), "dpbf16_ps", l);
    }
  }
  std::uniform_int_distribution<int> byte(0, 255), sbyte(-127, 127), nibble(0, 15);
  for (int trial = 0; trial < 200; ++trial) {
    alignas(64) uint8_t u[64], n[64], stored[64];
    alignas(64) int8_t s[64];
    alignas(64) int32_t acc[16], out[16];
    for (int i = 0; i < 64; ++i) {
      u[i] = uint8_t(trial == 0 ? 255 : byte(rng));  // trial 0: the extremes vpmaddubsw would saturate
      s[i] = int8_t(trial == 0 ? 127 : sbyte(rng));
      n[i] = uint8_t(nibble(rng));
      stored[i] = uint8_t(sbyte(rng) + 128);  // int8 weights as the GEMV stores them
    }
    for (int32_t& v : acc) v = std::uniform_int_distribution<int32_t>(-1 << 20, 1 << 20)(rng);
    const __m512i va = _mm512_loadu_si512(acc), vs = _mm512_loadu_si512(s);
    _mm512_storeu_si512(out, _mm512_dpbusd_epi32(va, _mm512_loadu_si512(u), vs));
    for (int l = 0; l < 16; ++l) {
      int32_t r = acc[l];
      for (int i = 0; i < 4; ++i) r += int32_t(u[4 * l + i]) * int32_t(s[4 * l + i]);
      check(out[l] == r, "dpbusd_epi32 (no saturation)", l);
    }
    // int4's block dot: kNibbleProductsInInt16 vpmaddubsw summed in int16, then widened; trial 0
    // takes the extremes (15 x -128 in every byte) that would overflow one more.
    alignas(64) int8_t sb[64];
    for (int i = 0; i < 64; ++i) sb[i] = trial == 0 ? int8_t(-128) : s[i];
    if (trial == 0) std::memset(n, 15, sizeof n);
    __m512i sums16 = _mm512_setzero_si512();
    for (int k = 0; k < kvflow_avx2::kNibbleProductsInInt16; ++k)
      sums16 = kvflow_avx2::maddubs_add_epi16(sums16, _mm512_loadu_si512(n), _mm512_loadu_si512(sb));
    _mm512_storeu_si512(out, kvflow_avx2::widen_pair_sums(sums16));
    for (int l = 0; l < 16; ++l) {
      int32_t r = 0;
      for (int i = 0; i < 4; ++i) r += int32_t(n[4 * l + i]) * int32_t(sb[4 * l + i]);
      check(out[l] == kvflow_avx2::kNibbleProductsInInt16 * r, "maddubs_add_epi16 + widen_pair_sums", l);
    }
    const kvflow_avx2::SignedWeights w = kvflow_avx2::signed_weights(_mm512_loadu_si512(stored));
    _mm512_storeu_si512(out, kvflow_avx2::dpbssd(va, w, vs));
    for (int l = 0; l < 16; ++l) {
      int32_t r = acc[l];
      for (int i = 0; i < 4; ++i) r += (int32_t(stored[4 * l + i]) - 128) * int32_t(s[4 * l + i]);
      check(out[l] == r, "dpbssd (signed weights)", l);
    }
  }
}

void check_conversions() {
  alignas(64) float f[32];
  const float specials[] = {0.0f, -0.0f, 1.0f, 1.00390625f /* tie: rounds to even */, 1.01171875f /* tie: up */,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), float_of(0x7f800001u) /* signalling NaN */,
                            std::numeric_limits<float>::denorm_min(), -1e-39f /* denormal */, 3.4e38f /* rounds to inf */};
  for (int trial = 0; trial < 50; ++trial) {
    for (int i = 0; i < 32; ++i) f[i] = random_float();
    if (trial == 0) std::memcpy(f, specials, sizeof(specials));
    alignas(64) uint16_t out[32];
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(f + 16), _mm512_loadu_ps(f)));
    for (int i = 0; i < 32; ++i) check(out[i] == ref_bf16(f[i]), "cvtne2ps_pbh", i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(f)));
    for (int i = 0; i < 16; ++i) check(out[i] == ref_bf16(f[i]), "cvtneps_pbh", i);
  }
  alignas(64) int32_t v[16];
  for (int i = 0; i < 16; ++i) v[i] = (i % 3 == 0 ? -1 : 1) * (i * 40 + (i == 5 ? 100000 : 0)) + (i == 7 ? 70000 : 0);
  alignas(16) int8_t narrow[16];
  alignas(32) int16_t words[16];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(narrow), _mm512_cvtsepi32_epi8(_mm512_loadu_si512(v)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words), _mm512_cvtepi32_epi16(_mm512_loadu_si512(v)));
  for (int i = 0; i < 16; ++i) {
    check(narrow[i] == int8_t(std::max(-128, std::min(127, v[i]))), "cvtsepi32_epi8 (saturating)", i);
    check(words[i] == int16_t(uint16_t(uint32_t(v[i]) & 0xffffu)), "cvtepi32_epi16 (truncating)", i);
  }
  alignas(16) uint8_t bytes[16];
  alignas(32) uint16_t halves[16];
  for (int i = 0; i < 16; ++i) bytes[i] = uint8_t(i * 17), halves[i] = uint16_t(i * 4099);
  const __m128i b128 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  _mm512_storeu_si512(v, _mm512_cvtepu8_epi32(b128));
  for (int i = 0; i < 16; ++i) check(v[i] == bytes[i], "cvtepu8_epi32", i);
  _mm512_storeu_si512(v, _mm512_cvtepi8_epi32(b128));
  for (int i = 0; i < 16; ++i) check(v[i] == int8_t(bytes[i]), "cvtepi8_epi32", i);
  _mm512_storeu_si512(v, _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves))));
  for (int i = 0; i < 16; ++i) check(v[i] == halves[i], "cvtepu16_epi32", i);
  for (int i = 0; i < 4; ++i) {
    alignas(16) uint8_t chunk[16];
    const __m512i whole = _mm512_loadu_si512(f);
    const __m128i part = i == 0 ? _mm512_extracti32x4_epi32(whole, 0)
                         : i == 1 ? _mm512_extracti32x4_epi32(whole, 1)
                         : i == 2 ? _mm512_extracti32x4_epi32(whole, 2)
                                  : _mm512_extracti32x4_epi32(whole, 3);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(chunk), part);
    check(std::memcmp(chunk, reinterpret_cast<const uint8_t*>(f) + 16 * i, 16) == 0, "extracti32x4_epi32", i);
  }
}

void check_permutes_and_masks() {
  alignas(64) float a[16], b[16], out[16];
  alignas(64) int32_t idx[16], iout[16];
  alignas(64) uint16_t w[32], widx[32], wout[32];
  for (int trial = 0; trial < 50; ++trial) {
    for (int i = 0; i < 16; ++i) a[i] = random_float(), b[i] = random_float(), idx[i] = int32_t(rng() & 0x3f);
    for (int i = 0; i < 32; ++i) w[i] = uint16_t(rng()), widx[i] = uint16_t(rng() & 0x7f);
    const __m512i vi = _mm512_loadu_si512(idx);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(vi, _mm512_loadu_ps(a)));
    for (int i = 0; i < 16; ++i) check(same_bits(out[i], a[idx[i] & 15]), "permutexvar_ps", i);
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(_mm512_loadu_ps(a), vi, _mm512_loadu_ps(b)));
    for (int i = 0; i < 16; ++i)
      check(same_bits(out[i], (idx[i] & 16 ? b : a)[idx[i] & 15]), "permutex2var_ps", i);
    _mm512_storeu_si512(iout, _mm512_permutex2var_epi32(_mm512_castps_si512(_mm512_loadu_ps(a)), vi,
                                                        _mm512_castps_si512(_mm512_loadu_ps(b))));
    for (int i = 0; i < 16; ++i)
      check(same_bits(float_of(uint32_t(iout[i])), (idx[i] & 16 ? b : a)[idx[i] & 15]), "permutex2var_epi32", i);
    _mm512_storeu_si512(wout, _mm512_permutexvar_epi16(_mm512_loadu_si512(widx), _mm512_loadu_si512(w)));
    for (int i = 0; i < 32; ++i) check(wout[i] == w[widx[i] & 31], "permutexvar_epi16", i);

    const __mmask16 k = __mmask16(rng());
    const __m512 va = _mm512_loadu_ps(a), vb = _mm512_loadu_ps(b);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(k, va, vb, _CMP_GT_OQ);
    _mm512_storeu_ps(out, _mm512_mask_max_ps(va, k, va, vb));
    for (int i = 0; i < 16; ++i) {
      const bool on = (k >> i) & 1;
      check(((gt >> i) & 1) == (on && a[i] > b[i]), "mask_cmp_ps_mask", i);
      check(same_bits(out[i], on ? std::max(a[i], b[i]) : a[i]), "mask_max_ps", i);
    }
    int32_t want = std::numeric_limits<int32_t>::max();
    for (int i = 0; i < 16; ++i) idx[i] = int32_t(rng()) >> 4;
    for (int i = 0; i < 16; ++i)
      if ((k >> i) & 1) want = std::min(want, idx[i]);
    check(_mm512_mask_reduce_min_epi32(k, _mm512_loadu_si512(idx)) == want, "mask_reduce_min_epi32", k);
    uint32_t ua[16], ub[16];
    for (int i = 0; i < 16; ++i) ua[i] = uint32_t(rng()), ub[i] = i % 4 == 0 ? ua[i] : uint32_t(rng());
    const __mmask16 ugt = _mm512_cmpgt_epu32_mask(_mm512_loadu_si512(ua), _mm512_loadu_si512(ub));
    for (int i = 0; i < 16; ++i) check(((ugt >> i) & 1) == (ua[i] > ub[i]), "cmpgt_epu32_mask", i);
    const __mmask16 eq = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(ua), _mm512_loadu_si512(ub));
    for (int i = 0; i < 16; ++i) check(((eq >> i) & 1) == (ua[i] == ub[i]), "cmpeq_epi32_mask", i);
    alignas(64) uint32_t shifted[16];
    _mm512_storeu_si512(shifted, _mm512_maskz_slli_epi32(k, _mm512_loadu_si512(ua), 7));
    for (int i = 0; i < 16; ++i)
      check(shifted[i] == (((k >> i) & 1) ? ua[i] << 7 : 0u), "maskz_slli_epi32", i);
  }
  alignas(64) int32_t set[16];
  _mm512_storeu_si512(set, _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  for (int i = 0; i < 16; ++i) check(set[i] == i, "set_epi32 (highest lane first)", i);
  _mm512_storeu_si512(set, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (int i = 0; i < 16; ++i) check(set[i] == i, "setr_epi32", i);
}

void check_arithmetic() {
  alignas(64) float x[16], out[16];
  for (int i = 0; i < 16; ++i) x[i] = float(i * 37 % 23) - 11.25f;
  const __m512 v = _mm512_loadu_ps(x);
  float sum = 0.0f, top = -1e30f;
  for (float f : x) sum += f, top = std::max(top, f);
  check(_mm512_reduce_add_ps(v) == sum, "reduce_add_ps (exact on these values)", 0);
  check(_mm512_reduce_max_ps(v) == top, "reduce_max_ps", 0);
  const float exps[16] = {0, 1, -1, 10, -10, 126, -126, 127, 128, 200, -200, -149, 3, -3, 64, -64};
  _mm512_storeu_ps(out, _mm512_scalef_ps(_mm512_set1_ps(1.5f), _mm512_loadu_ps(exps)));
  for (int i = 0; i < 16; ++i) {
    const double want = 1.5 * std::ldexp(1.0, int(exps[i]));
    const float expect = want > 3.4028234663852886e38 ? std::numeric_limits<float>::infinity() : float(want);
    // below the normal range vscalefps gives a denormal; the stand-in (exp_lanes clamps its
    // argument to >= -87, so never there) only needs the normal range and overflow.
    if (exps[i] >= -125) check(same_bits(out[i], expect), "scalef_ps", i);
  }
  for (int i = 0; i < 16; ++i) x[i] = -8.0f + float(i) + (i % 2 ? 0.5f : 0.25f);
  _mm512_storeu_ps(out, _mm512_roundscale_ps(_mm512_loadu_ps(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (int i = 0; i < 16; ++i) check(out[i] == std::nearbyint(x[i]), "roundscale_ps (nearest even)", i);
}

// Masked loads and stores touch no byte outside their mask: data ending at a page whose successor
// is unmapped loads and stores without a fault, and masked-off lanes read as zero.
void check_masked_memory() {
  const long page = sysconf(_SC_PAGESIZE);
  auto* region = static_cast<uint8_t*>(mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (region == MAP_FAILED) return;
  mprotect(region + page, page, PROT_NONE);
  uint8_t* end = region + page;
  for (int n = 1; n < 16; ++n) {  // n valid lanes right before the unmapped page
    const __mmask16 k = __mmask16((1u << n) - 1u);
    auto* fp = reinterpret_cast<float*>(end) - n;
    for (int i = 0; i < n; ++i) fp[i] = float(i + 1);
    alignas(64) float out[16];
    _mm512_storeu_ps(out, _mm512_maskz_loadu_ps(k, fp));
    for (int i = 0; i < 16; ++i) check(out[i] == (i < n ? float(i + 1) : 0.0f), "maskz_loadu_ps", i);
    _mm512_mask_storeu_ps(fp, k, _mm512_set1_ps(-2.0f));
    for (int i = 0; i < n; ++i) check(fp[i] == -2.0f, "mask_storeu_ps", i);
    auto* ip = reinterpret_cast<int32_t*>(end) - n;
    alignas(64) int32_t iout[16];
    _mm512_storeu_si512(iout, _mm512_maskz_loadu_epi32(k, ip));
    for (int i = 0; i < 16; ++i) check(iout[i] == (i < n ? int32_t(bits_of(-2.0f)) : 0), "maskz_loadu_epi32", i);
    auto* hp = reinterpret_cast<uint16_t*>(end) - n;
    for (int i = 0; i < n; ++i) hp[i] = uint16_t(1000 + i);
    alignas(32) uint16_t hout[16];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hout), _mm256_maskz_loadu_epi16(k, hp));
    for (int i = 0; i < 16; ++i) check(hout[i] == (i < n ? 1000 + i : 0), "mm256_maskz_loadu_epi16", i);
    _mm256_mask_storeu_epi16(hp, k, _mm256_set1_epi16(7));
    for (int i = 0; i < n; ++i) check(hp[i] == 7, "mm256_mask_storeu_epi16", i);
    auto* bp = end - n;
    for (int i = 0; i < n; ++i) bp[i] = uint8_t(200 + i);
    alignas(16) uint8_t bout[16];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(bout), _mm_maskz_loadu_epi8(k, bp));
    for (int i = 0; i < 16; ++i) check(bout[i] == (i < n ? 200 + i : 0), "mm_maskz_loadu_epi8", i);
  }
  for (int n = 1; n < 32; ++n) {
    const __mmask32 k = (__mmask32(1) << n) - 1;
    auto* hp = reinterpret_cast<uint16_t*>(end) - n;
    for (int i = 0; i < n; ++i) hp[i] = uint16_t(3000 + i);
    alignas(64) uint16_t hout[32];
    _mm512_storeu_si512(hout, _mm512_maskz_loadu_epi16(k, hp));
    for (int i = 0; i < 32; ++i) check(hout[i] == (i < n ? 3000 + i : 0), "maskz_loadu_epi16", i);
  }
  munmap(region, 2 * page);
}

}  // namespace

int main() {
  check_dot_products();
  check_conversions();
  check_permutes_and_masks();
  check_arithmetic();
  check_masked_memory();
  std::printf("%d failed checks\n", failures);
  return failures == 0 ? 0 : 1;
}
