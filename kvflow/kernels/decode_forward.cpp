// The decoder layers of a decode step in one native call: no Python between the kernels.
//
// Why: at batch 1 a step of the 0.5B shape spends ~1.8 ms between the kernels in Python (module
// calls, views, the dispatcher from Python; benchmarks/NOTES.md): ~8% of a bf16 step and twice
// that once weights are quantized. Here the per-layer loop runs in C++ and calls the same kernels.
//
// Numerics: bit-identical to the Python path (kvflow/models/llama.py), by construction:
//   - the linears call the very functions the Python modules call (the native GEMVs, oneDNN's
//     blocked GEMM for bf16 and dequantize-and-GEMM tiles for int8/int4 above max_gemv_rows),
//     with the same dispatch threshold, which each Python module hands over;
//   - RMSNorm and SiLU-and-mul of the hidden rows are elementwise.cpp's kernels, which the Python
//     layers call too (kvflow/layers/norm.py, activation.py); Qwen3's per-head q/k norms are
//     ATen's F.rms_norm on both paths;
//   - the element-wise steps are done here with ATen's bf16 rounding: every bf16 op computes in
//     fp32 and rounds once to nearest even, so residual adds are bf16(a + b) and RoPE is
//     bf16(bf16(x * cos) + bf16(roll(x) * sin_signed)), as kvflow/layers/rotary.py computes it;
//   - K/V are written with the formats of kvflow/attention/kv_layer.py, quantized the same way
//     (per token and head, fp32 arithmetic, round half to even, fp16 scales).
// tests/models/test_native_decode.py checks logits equal bit for bit against the Python path.
//
// Shapes (M decode rows: one per decoding request, or 1 + k per request verifying k drafts):
//   hidden [M, H] bf16; cos, sin_signed [M, D] bf16; slot_mapping [M] int64;
//   kv_slots [M, L] int64 (each row's key slots, padded); num_keys [M] int64.

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <ATen/core/dispatch/Dispatcher.h>  // onednn_linear calls mkldnn's op by its schema
#include <ATen/TensorOperators.h>  // a + b, a * b on the fallback paths
// The operators the fallback paths call, beyond aten_lite.h's allocation.
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/zeros.h>
#include "aten_lite.h"

#include "bf16_utils.h"
#include "decode_forward.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace kvflow {
namespace {

constexpr int64_t kPrefillTileElements = 4 << 20;  // kvflow/quant/linear.py PREFILL_TILE_ELEMENTS
constexpr int64_t kInt4TileRows = 16;              // kvflow/quant/linear.py INT4_TILE_ROWS
constexpr int64_t kInt8TileRows = 16;              // kvflow/quant/linear.py INT8_TILE_ROWS
constexpr int64_t kGgmlQ8_0 = 8;
constexpr int64_t kFp8MaxRows = 8;                 // gemv_fp8.cpp kMaxRows (kvflow/quant/fp8.py FP8_GEMV_MAX_ROWS)                   // ggml's type id of Q8_0 (kvflow/quant/gguf_linear.py)
constexpr float kInt8Max = 127.0f;         // kvflow/attention/kv_layer.py INT8_MAX
constexpr float kFp8E4m3Max = 448.0f;      // FP8_E4M3_MAX
constexpr float kInt4Levels = 15.0f;       // INT4_LEVELS
constexpr float kMinScale = 1e-8f;         // MIN_SCALE

inline float through_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

const uint16_t* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bf16_ptr_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// oneDNN's GEMM on a weight reordered at load, the op kvflow/layers/linear.py calls past max_gemv_rows.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                               std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), "");
}

// Whether oneDNN has a bf16 GEMM on this CPU (kvflow/layers/bf16_gemm.py onednn_bf16_gemm).
bool onednn_bf16_gemm() {
  static const bool supported = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("mkldnn::_is_mkldnn_bf16_supported", "")
                                    .typed<bool()>()
                                    .call();
  return supported;
}

// x [T, K] bf16 as the CPU's fast GEMM takes it: itself for oneDNN's bf16 GEMM, widened to fp32
// where there is none (AVX2 CPUs). Widened once per linear, not once per row block.
at::Tensor gemm_input(const at::Tensor& x) { return onednn_bf16_gemm() ? x : x.to(at::kFloat); }

// gemm_input(x) [T, K] @ w [N, K] bf16 (+ bias) -> [T, N] bf16 on the CPU's fast GEMM, as
// kvflow/layers/bf16_gemm.py bf16_linear computes it (in fp32 there, the bias included).
at::Tensor bf16_linear(const at::Tensor& x_gemm, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias = c10::nullopt) {
  if (onednn_bf16_gemm()) return at::linear(x_gemm, w, bias);
  const c10::optional<at::Tensor> bias_wide =
      bias.has_value() ? c10::optional<at::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
  return at::linear(x_gemm, w.to(at::kFloat), bias_wide).to(at::kBFloat16);
}

// Prefill-sized rows of a quantized linear: row blocks dequantized to bf16 and multiplied by
// bf16_linear one at a time (kvflow/quant/linear.py _gemm_over_tiles).
template <typename Dequantize>
at::Tensor gemm_over_tiles(const at::Tensor& x, int64_t N, int64_t K, int64_t row_multiple,
                              const Dequantize& dequantize, const c10::optional<at::Tensor>& bias) {
  const int64_t rows = std::max<int64_t>(row_multiple, kPrefillTileElements / K / row_multiple * row_multiple);
  const at::Tensor x_gemm = gemm_input(x);
  std::vector<at::Tensor> parts;
  for (int64_t n0 = 0; n0 < N; n0 += rows) parts.push_back(bf16_linear(x_gemm, dequantize(n0, std::min(N, n0 + rows))));
  at::Tensor y = parts.size() == 1 ? parts[0] : at::cat(parts, 1);
  return bias.has_value() ? y + *bias : y;
}

}  // namespace

at::Tensor NativeLinear::forward(const at::Tensor& x_in) const {
  const int64_t M = x_in.size(0);
  switch (kind) {
    case Kind::kBf16:
      if (M <= max_gemv_rows) return skinny_linear_bf16(x_in, weight, out_features, bias);
      if (packed_is_blocked) return onednn_linear(x_in, packed, bias);
      return bf16_linear(gemm_input(x_in), packed, bias);
    case Kind::kInt8:
      if (M <= max_gemv_rows) return skinny_linear_int8(x_in, weight, scales, bias);
      return gemm_over_tiles(
          x_in, out_features, in_features, kInt8TileRows,
          [&](int64_t n0, int64_t n1) { return dequantize_int8_rows(weight, scales, in_features, n0, n1); }, bias);
    case Kind::kInt4: {
      const at::Tensor x = perm.has_value() ? x_in.index_select(1, *perm) : x_in;
      if (M <= max_gemv_rows) return skinny_linear_int4(x, weight, scales, mins, group_size, out_features, bias);
      return gemm_over_tiles(
          x, out_features, in_features, kInt4TileRows,
          [&](int64_t n0, int64_t n1) {
            return dequantize_int4_rows(weight, scales, mins, group_size, out_features, n0, n1);
          },
          bias);
    }
    case Kind::kGgml:
      if (ggml_type == kGgmlQ8_0) {
        if (M <= max_gemv_rows) return skinny_linear_q8_0(x_in, weight, scales, out_features, bias);
        return gemm_over_tiles(
            x_in, out_features, in_features, kInt8TileRows,
            [&](int64_t n0, int64_t n1) { return dequantize_q8_0_rows(weight, scales, in_features, out_features, n0, n1); },
            bias);
      }
      if (M <= max_gemv_rows) return skinny_linear_ggml(x_in, ggml_type, weight, scales, mins, supers, out_features, bias);
      return gemm_over_tiles(
          x_in, out_features, in_features, kInt4TileRows,
          [&](int64_t n0, int64_t n1) {
            return dequantize_ggml_rows(ggml_type, weight, scales, mins, supers, out_features, n0, n1);
          },
          bias);
    case Kind::kConcat: {
      std::vector<at::Tensor> outs;
      for (const auto& part : parts) outs.push_back(part->forward(x_in));
      return at::cat(outs, 1);
    }
    case Kind::kFp8:
      if (M <= kFp8MaxRows) return skinny_linear_fp8(x_in, weight, scales, group_size, bias);
      // More rows: row blocks widened to bf16 (e4m3 -> fp32, times the scale, rounded once) and
      // multiplied, as kvflow/quant/fp8.py Fp8Linear.forward does.
      return gemm_over_tiles(
          x_in, out_features, in_features, 1,
          [&](int64_t n0, int64_t n1) {
            const at::Tensor w = weight.slice(0, n0, n1).view(at::kFloat8_e4m3fn).to(at::kFloat);
            const at::Tensor s =
                scales.slice(0, n0, n1).repeat_interleave(group_size, 1).slice(1, 0, in_features);
            return (w * s).to(at::kBFloat16);
          },
          bias);
  }
  TORCH_CHECK(false, "unreachable");
}

at::Tensor NativeLinear::greedy(const at::Tensor& x_in) const {
  const int64_t M = x_in.size(0);
  if (M > max_gemv_rows) return argmax_rows(forward(x_in));
  switch (kind) {
    case Kind::kBf16:
      return skinny_linear_bf16_greedy(x_in, weight, out_features, bias);
    case Kind::kInt8:
      return skinny_linear_int8_greedy(x_in, weight, scales, bias);
    case Kind::kInt4:
      return skinny_linear_int4_greedy(perm.has_value() ? x_in.index_select(1, *perm) : x_in, weight, scales, mins,
                                       group_size, out_features, bias);
    case Kind::kGgml:
      if (ggml_type == kGgmlQ8_0) return skinny_linear_q8_0_greedy(x_in, weight, scales, out_features, bias);
      return skinny_linear_ggml_greedy(x_in, ggml_type, weight, scales, mins, supers, out_features, bias);
    case Kind::kConcat:
    case Kind::kFp8:
      return argmax_rows(forward(x_in));
  }
  TORCH_CHECK(false, "unreachable");
}

namespace {

// Quantize one token-head x[0..D) into a pool row, as _QuantizedPool.write does.
void quantize_row(const std::string& kind, const float* x, int64_t D, void* data, c10::Half* scale, c10::Half* zero) {
  if (kind == "int4") {
    float lo = x[0], hi = x[0];
    for (int64_t d = 1; d < D; ++d) lo = std::min(lo, x[d]), hi = std::max(hi, x[d]);
    const float s = std::max((hi - lo) / kInt4Levels, kMinScale);
    auto* out = static_cast<uint8_t*>(data);
    for (int64_t d = 0; d < D; d += 2) {  // element 2i in the low nibble, 2i + 1 in the high one
      const float a = std::clamp(std::nearbyint((x[d] - lo) / s), 0.0f, kInt4Levels);
      const float b = std::clamp(std::nearbyint((x[d + 1] - lo) / s), 0.0f, kInt4Levels);
      out[d / 2] = static_cast<uint8_t>(uint8_t(a) | (uint8_t(b) << 4));
    }
    *scale = c10::Half(s);
    *zero = c10::Half(lo);
    return;
  }
  const float top = kind == "int8" ? kInt8Max : kFp8E4m3Max;
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float s = std::max(amax / top, kMinScale);
  if (kind == "int8") {
    auto* out = static_cast<int8_t*>(data);
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / s), -top, top));
  } else {
    auto* out = static_cast<uint8_t*>(data);
    for (int64_t d = 0; d < D; ++d) out[d] = c10::Float8_e4m3fn(x[d] / s).x;
  }
  *scale = c10::Half(s);
}

}  // namespace

// One token-head of K or V (fp32 values) into pool row `slot`.
void NativeKVLayer::write_row(bool is_key, int64_t slot, int64_t head, const float* x) const {
  const int64_t D = head_dim;
  if (kind == "plain") {
    at::Tensor pool = is_key ? key_data : value_data;
    auto* out = reinterpret_cast<uint16_t*>(pool.data_ptr<at::BFloat16>()) + (slot * num_kv_heads + head) * D;
    for (int64_t d = 0; d < D; ++d) out[d] = float_to_bf16(x[d]);  // x holds bf16 values: exact
    return;
  }
  const at::Tensor& data = is_key ? key_data : value_data;
  const at::Tensor& scale = is_key ? key_scale : value_scale;
  const at::Tensor& zero = is_key ? key_zero : value_zero;
  const int64_t row = slot * num_kv_heads + head;
  const int64_t width = kind == "int4" ? D / 2 : D;
  void* out = static_cast<uint8_t*>(data.data_ptr()) + row * width;
  auto* s = scale.data_ptr<c10::Half>() + row;
  auto* z = kind == "int4" ? zero.data_ptr<c10::Half>() + row : nullptr;
  quantize_row(kind, x, D, out, s, z);
}

at::Tensor NativeKVLayer::attend(const at::Tensor& q, const at::Tensor& kv_slots, const at::Tensor& num_keys,
                                    double scale) const {
  if (kind == "plain") return paged_decode_attention_bf16(q, key_data, value_data, kv_slots, num_keys, scale);
  return paged_decode_attention_quantized(q, key_data, key_scale, key_zero, value_data, value_scale, value_zero, kv_slots,
                                          num_keys, scale, kind);
}

namespace {

// RoPE on q and k (kvflow/layers/rotary.py apply_rotary, same roundings), q to `q_out`, rotated k
// and v into the pool at each row's slot. q_in [M, Hq, D], k_in [M, Hkv, D], v [M, Hkv, D]: any
// row/head strides, unit stride along D. cos, sin_signed [M, D] bf16. Rows are independent (each
// writes its own q row and its own slot), so several rows are split over the threads (8 rows: ~9.5
// us a layer on one); a lone row stays on the calling thread, where a parallel region costs more
// than it saves.
void rope_and_write_kv(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v,
                       const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                       const NativeKVLayer& kv, at::Tensor& q_out) {
  const int64_t M = q_in.size(0), Hq = q_in.size(1), Hkv = k_in.size(1), D = q_in.size(2), half = D / 2;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const uint16_t* cp = bf16_ptr(cos);
  const uint16_t* sp = bf16_ptr(sin);
  uint16_t* qo = bf16_ptr_mut(q_out);
  const auto rows = [&](int64_t m_begin, int64_t m_end) {
    // Vectorised over D, 16 lanes at a time, with the scalar float_to_bf16's rounding (bf16_utils.h).
    std::vector<float> xf(D), rolled(D), row(D);
    const auto rotate = [&](const uint16_t* x, const uint16_t* c, const uint16_t* s, float* out) {
      for (int64_t d = 0; d < D; ++d) xf[d] = bf16_to_float(x[d]);
      std::memcpy(rolled.data(), xf.data() + half, (D - half) * sizeof(float));  // roll(x, D/2)
      std::memcpy(rolled.data() + (D - half), xf.data(), half * sizeof(float));
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = lanes_left(D - d);
        const __m512 a =
            through_bf16_lanes(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xf.data() + d), load_bf16_lanes(c + d, m)));
        const __m512 b =
            through_bf16_lanes(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, rolled.data() + d), load_bf16_lanes(s + d, m)));
        _mm512_mask_storeu_ps(out + d, m, through_bf16_lanes(_mm512_add_ps(a, b)));
      }
    };
    for (int64_t m = m_begin; m < m_end; ++m) {
      const uint16_t* c = cp + m * D;
      const uint16_t* s = sp + m * D;
      for (int64_t h = 0; h < Hq; ++h) {
        const uint16_t* x = bf16_ptr(q_in) + m * q_in.stride(0) + h * q_in.stride(1);
        rotate(x, c, s, row.data());
        for (int64_t d = 0; d < D; d += 16)  // row holds bf16 values: the store is exact
          store_bf16_lanes(qo + (m * Hq + h) * D + d, _mm512_maskz_loadu_ps(lanes_left(D - d), row.data() + d),
                           lanes_left(D - d));
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        rotate(bf16_ptr(k_in) + m * k_in.stride(0) + h * k_in.stride(1), c, s, row.data());
        kv.write_row(true, slots[m], h, row.data());
        const uint16_t* x = bf16_ptr(v) + m * v.stride(0) + h * v.stride(1);
        for (int64_t d = 0; d < D; ++d) row[d] = bf16_to_float(x[d]);
        kv.write_row(false, slots[m], h, row.data());
      }
    }
  };
  if (M == 1) return rows(0, 1);
  at::parallel_for(0, M, 1, rows);
}

// y = bf16(a + b) in place into a (the residual stream), ATen's rounding.
void add_into(at::Tensor& a, const at::Tensor& b) {
  uint16_t* ap = bf16_ptr_mut(a);
  const uint16_t* bp = bf16_ptr(b);
  const int64_t n = a.numel();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes_left(n - i);
    store_bf16_lanes(ap + i, _mm512_add_ps(load_bf16_lanes(ap + i, m), load_bf16_lanes(bp + i, m)), m);
  }
}

}  // namespace

const char* const kDecodePieceNames[kNumDecodePieces] = {
    "input_norm",   "qkv_proj",     "rope_kv_write", "attention", "o_proj",     "residual_post_norm",
    "gate_up_proj", "silu_and_mul", "down_proj",     "residual",  "final_norm",
};

namespace {

// Adds the time since the previous mark to piece_us[piece]; does nothing (no clock read) when
// piece_us is null, so the plain forward pays one predictable branch per piece.
class PieceClock {
 public:
  explicit PieceClock(double* piece_us) : piece_us_(piece_us) {
    if (piece_us_) last_ = std::chrono::steady_clock::now();
  }
  void mark(DecodePiece piece) {
    if (!piece_us_) return;
    const auto now = std::chrono::steady_clock::now();
    piece_us_[piece] += std::chrono::duration<double, std::micro>(now - last_).count();
    last_ = now;
  }

 private:
  double* piece_us_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace

at::Tensor NativeDecoder::forward(at::Tensor hidden, at::Tensor cos, at::Tensor sin_signed,
                                     at::Tensor slot_mapping, at::Tensor kv_slots, at::Tensor num_keys) const {
  return run(std::move(hidden), std::move(cos), std::move(sin_signed), slot_mapping, kv_slots, num_keys, nullptr);
}

at::Tensor NativeDecoder::forward_rows(c10::optional<at::Tensor> hidden_in, const std::vector<int64_t>& token_ids,
                                          const std::vector<int64_t>& positions,
                                          const std::vector<std::vector<int64_t>>& block_tables) const {
  const int64_t M = static_cast<int64_t>(positions.size()), D = head_dim;
  TORCH_CHECK(block_size > 0 && rope_cos.defined(), "forward_rows needs set_paging first");
  TORCH_CHECK(static_cast<int64_t>(token_ids.size()) == M && static_cast<int64_t>(block_tables.size()) == M,
              "one token, one position and one block table per row");
  at::Tensor hidden;
  if (hidden_in.has_value()) {
    hidden = *hidden_in;
    TORCH_CHECK(hidden.size(0) == M, "one hidden row per token");
  } else {  // the embedding lookup: a plain gather of bf16 rows (nn.Embedding's forward)
    TORCH_CHECK(embedding.defined(), "forward_rows without hidden needs set_embedding first");
    const int64_t V = embedding.size(0), H = embedding.size(1);
    hidden = at::empty({M, H}, embedding.options());
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(0 <= token_ids[m] && token_ids[m] < V, "token id ", token_ids[m], " outside the vocabulary");
      std::memcpy(bf16_ptr_mut(hidden) + m * H, bf16_ptr(embedding) + token_ids[m] * H, H * sizeof(uint16_t));
    }
  }
  const int64_t num_positions = rope_cos.size(0);
  auto cos = at::empty({M, D}, rope_cos.options());
  auto sin_signed = at::empty({M, D}, rope_cos.options());
  auto slot_mapping = at::empty({M}, at::kLong);
  auto num_keys = at::empty({M}, at::kLong);
  int64_t* slot_out = slot_mapping.data_ptr<int64_t>();
  int64_t* keys_out = num_keys.data_ptr<int64_t>();
  std::vector<int64_t> first_key(M);
  int64_t max_keys = 0;
  // Row m attends positions first_key[m] .. positions[m] (input_batch.py _first_key_position).
  for (int64_t m = 0; m < M; ++m) {
    const int64_t p = positions[m];
    TORCH_CHECK(0 <= p && p < num_positions, "position ", p, " outside the RoPE tables");
    TORCH_CHECK(p / block_size < static_cast<int64_t>(block_tables[m].size()), "position ", p,
                " past the row's block table");
    first_key[m] = sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
    keys_out[m] = p - first_key[m] + 1;
    max_keys = std::max(max_keys, keys_out[m]);
    slot_out[m] = block_tables[m][p / block_size] * block_size + p % block_size;
    std::memcpy(bf16_ptr_mut(cos) + m * D, bf16_ptr(rope_cos) + p * D, D * sizeof(uint16_t));
    std::memcpy(bf16_ptr_mut(sin_signed) + m * D, bf16_ptr(rope_sin_signed) + p * D, D * sizeof(uint16_t));
  }
  // [M, max_keys]: each row's key slots in position order, padded with slot 0 (never read).
  auto kv_slots = at::zeros({M, max_keys}, at::kLong);
  for (int64_t m = 0; m < M; ++m) {
    int64_t* out = kv_slots.data_ptr<int64_t>() + m * max_keys;
    const std::vector<int64_t>& table = block_tables[m];
    for (int64_t pos = first_key[m]; pos <= positions[m]; ++pos)
      *out++ = table[pos / block_size] * block_size + pos % block_size;
  }
  return run(std::move(hidden), cos, sin_signed, slot_mapping, kv_slots, num_keys, nullptr);
}

std::tuple<at::Tensor, at::Tensor> NativeDecoder::forward_profiled(at::Tensor hidden, at::Tensor cos,
                                                                         at::Tensor sin_signed,
                                                                         at::Tensor slot_mapping,
                                                                         at::Tensor kv_slots,
                                                                         at::Tensor num_keys) const {
  at::Tensor piece_us = at::zeros({kNumDecodePieces}, at::kDouble);
  at::Tensor out = run(std::move(hidden), std::move(cos), std::move(sin_signed), slot_mapping, kv_slots, num_keys,
                          piece_us.data_ptr<double>());
  return {out, piece_us};
}

at::Tensor NativeDecoder::run(at::Tensor hidden, at::Tensor cos, at::Tensor sin_signed,
                                 const at::Tensor& slot_mapping, const at::Tensor& kv_slots,
                                 const at::Tensor& num_keys, double* piece_us) const {
  TORCH_CHECK(hidden.dtype() == at::kBFloat16 && hidden.dim() == 2, "bf16 [M, H] hidden states expected");
  const int64_t M = hidden.size(0);
  hidden = hidden.contiguous().clone();  // the residual stream, updated in place
  cos = cos.reshape({M, head_dim}).contiguous();
  sin_signed = sin_signed.reshape({M, head_dim}).contiguous();
  const double scale = std::pow(double(head_dim), -0.5);
  const int64_t q_size = num_heads * head_dim;
  PieceClock clock(piece_us);
  for (size_t i = 0; i < layers.size(); ++i) {
    const NativeDecoderLayer& layer = layers[i];
    const at::Tensor h = rms_norm_bf16(hidden, layer.input_norm, eps);
    clock.mark(kInputNorm);
    const at::Tensor qkv = layer.qkv->forward(h).view({M, num_heads + 2 * num_kv_heads, head_dim});
    clock.mark(kQkvProj);
    at::Tensor q_in = qkv.slice(1, 0, num_heads);
    at::Tensor k_in = qkv.slice(1, num_heads, num_heads + num_kv_heads);
    const at::Tensor v = qkv.slice(1, num_heads + num_kv_heads);
    if (layer.q_norm.has_value()) {  // Qwen3: RMSNorm per head before RoPE
      q_in = at::rms_norm(q_in, {head_dim}, *layer.q_norm, eps);
      k_in = at::rms_norm(k_in, {head_dim}, *layer.k_norm, eps);
    }
    at::Tensor q = at::empty({M, num_heads, head_dim}, hidden.options());
    rope_and_write_kv(q_in, k_in, v, cos, sin_signed, slot_mapping, kv_layers[i], q);
    clock.mark(kRopeKvWrite);
    const at::Tensor attn = kv_layers[i].attend(q, kv_slots, num_keys, scale);
    clock.mark(kAttention);
    at::Tensor o = layer.o->forward(attn.reshape({M, q_size}));
    clock.mark(kOProj);
    if (all_reduce) all_reduce(o);
    add_into(hidden, o);
    const at::Tensor post = rms_norm_bf16(hidden, layer.post_norm, eps);
    clock.mark(kResidualPostNorm);
    const at::Tensor gate_up = layer.gate_up->forward(post);
    clock.mark(kGateUpProj);
    const at::Tensor act = silu_and_mul_bf16(gate_up);
    clock.mark(kSiluAndMul);
    at::Tensor down = layer.down->forward(act);
    clock.mark(kDownProj);
    if (all_reduce) all_reduce(down);
    add_into(hidden, down);
    clock.mark(kResidual);
  }
  at::Tensor out = rms_norm_bf16(hidden, final_norm, eps);
  clock.mark(kFinalNorm);
  return out;
}

}  // namespace kvflow
