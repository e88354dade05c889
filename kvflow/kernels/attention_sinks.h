// Attention sinks (gpt-oss): query head h's softmax has one more logit s_h that carries no value,
//   p_j = exp(score_j - m) / (sum_k exp(score_k - m) + exp(s_h - m)),   out = sum_j p_j V_j,
// with m the maximum over the scores and s_h. The attention kernels (paged_decode_attention.cpp,
// prefill_attention.cpp) fold s_h into their softmax as a start value: the running max starts at
// s_h and the running sum at exp(s_h - s_h) = 1. "No sink" is s_h = -inf, which leaves every
// maximum and sum, and so every output bit, as without the argument.
// kvflow's build cache hashes the headers with the sources (kvflow/kernels/build_cache.py):
// editing this file rebuilds the kernels.
#pragma once

#include "aten_lite.h"

#include <cstdint>
#include <limits>

namespace kvflow {

constexpr float kNoSink = -std::numeric_limits<float>::infinity();

// The sink logits of a call: sinks [Hq] fp32 (one per query head), or none (nullptr). `keep` holds
// the contiguous tensor the pointer reads for the duration of the call.
inline const float* sink_logits(const c10::optional<at::Tensor>& sinks, int64_t Hq, at::Tensor& keep) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  keep = sinks->contiguous();
  TORCH_CHECK(keep.dtype() == at::kFloat && keep.dim() == 1 && keep.size(0) == Hq,
              "sinks: [num query heads] float32 expected");
  return keep.data_ptr<float>();
}

// Query head `head`'s sink logit, kNoSink when the call has none.
inline float sink_of(const float* sinks, int64_t head) { return sinks == nullptr ? kNoSink : sinks[head]; }

}  // namespace kvflow
