// Shared helpers of kvflow's bf16 CPU kernels.
// Note: torch's JIT builder hashes the .cpp sources, not headers: after editing this file, touch
// a .cpp (or clear ~/.cache/kvflow/kernels) to force a rebuild.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvflow {

// float32 -> bfloat16 with round-to-nearest-even, as torch casts (NaN stays a quiet NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// bfloat16 -> float32: bf16 is the top half of an fp32 (exact).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace kvflow
