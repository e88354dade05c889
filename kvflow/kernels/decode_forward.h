// The native decode forward's weights and KV pools (decode_forward.cpp), built once at load from
// the Python modules (kvflow/models/native_decoder.py) and bound to Python in bindings.cpp.
#pragma once

#include "aten_lite.h"

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

at::Tensor tile_bf16_weight(at::Tensor w);
at::Tensor rms_norm_bf16(at::Tensor x, at::Tensor weight, double eps);
at::Tensor silu_and_mul_bf16(at::Tensor gate_up);
at::Tensor skinny_linear_bf16(at::Tensor x, at::Tensor w_tiles, int64_t out_features,
                                 c10::optional<at::Tensor> bias);
// The *_greedy GEMVs: each row's argmax of what the plain GEMV returns, [M] int64 (argmax_lanes.h).
at::Tensor skinny_linear_bf16_greedy(at::Tensor x, at::Tensor w_tiles, int64_t out_features,
                                        c10::optional<at::Tensor> bias);
at::Tensor skinny_linear_int8_greedy(at::Tensor x, at::Tensor tiles, at::Tensor scales,
                                        c10::optional<at::Tensor> bias);
at::Tensor skinny_linear_int4_greedy(at::Tensor x, at::Tensor packed, at::Tensor scales,
                                        at::Tensor mins, int64_t group_size, int64_t out_features,
                                        c10::optional<at::Tensor> bias);
at::Tensor argmax_rows(at::Tensor logits);
at::Tensor skinny_linear_int8(at::Tensor x, at::Tensor tiles, at::Tensor scales,
                                 c10::optional<at::Tensor> bias);
at::Tensor skinny_linear_int4(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor mins,
                                 int64_t group_size, int64_t out_features, c10::optional<at::Tensor> bias);
at::Tensor dequantize_int4_rows(at::Tensor packed, at::Tensor scales, at::Tensor mins,
                                   int64_t group_size, int64_t out_features, int64_t n_begin, int64_t n_end);
at::Tensor dequantize_int8_rows(at::Tensor tiles, at::Tensor scales, int64_t in_features, int64_t n_begin,
                                   int64_t n_end);
// GGUF block types (gemv_int8.cpp: Q8_0 on the int8 tiles with fp16 block scales; gemv_ggml.cpp:
// Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K by their ggml type id).
at::Tensor skinny_linear_q8_0(at::Tensor x, at::Tensor tiles, at::Tensor block_scales,
                                 int64_t out_features, c10::optional<at::Tensor> bias);
at::Tensor skinny_linear_q8_0_greedy(at::Tensor x, at::Tensor tiles, at::Tensor block_scales,
                                        int64_t out_features, c10::optional<at::Tensor> bias);
at::Tensor dequantize_q8_0_rows(at::Tensor tiles, at::Tensor block_scales, int64_t in_features,
                                   int64_t out_features, int64_t n_begin, int64_t n_end);
// FP8 e4m3 weights with block scales (gemv_fp8.cpp), up to kFp8MaxRows rows per call.
at::Tensor skinny_linear_fp8(at::Tensor x, at::Tensor q, at::Tensor scale, int64_t block,
                                c10::optional<at::Tensor> bias);
at::Tensor skinny_linear_ggml(at::Tensor x, int64_t type, at::Tensor values, at::Tensor scales,
                                 at::Tensor mins, at::Tensor supers, int64_t out_features,
                                 c10::optional<at::Tensor> bias);
at::Tensor skinny_linear_ggml_greedy(at::Tensor x, int64_t type, at::Tensor values, at::Tensor scales,
                                        at::Tensor mins, at::Tensor supers, int64_t out_features,
                                        c10::optional<at::Tensor> bias);
at::Tensor dequantize_ggml_rows(int64_t type, at::Tensor values, at::Tensor scales, at::Tensor mins,
                                   at::Tensor supers, int64_t out_features, int64_t n_begin, int64_t n_end);
// sinks: [Hq] fp32 sink logits (attention_sinks.h); the native decode forward passes none.
at::Tensor paged_decode_attention_bf16(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                          at::Tensor slots, at::Tensor seq_lens, double scale,
                                          c10::optional<at::Tensor> sinks = c10::nullopt);
at::Tensor paged_decode_attention_quantized(at::Tensor q, at::Tensor k_data, at::Tensor k_scale,
                                               at::Tensor k_zero, at::Tensor v_data, at::Tensor v_scale,
                                               at::Tensor v_zero, at::Tensor slots, at::Tensor seq_lens,
                                               double scale, const std::string& kind,
                                               c10::optional<at::Tensor> sinks = c10::nullopt);

namespace kvflow {

// One linear layer in the form its kernels read (kvflow/layers/linear.py, kvflow/quant/linear.py).
struct NativeLinear {
  // kGgml: a GGUF block type (ggml_type: 8 = Q8_0 on int8 tiles, else gemv_ggml.cpp's); kConcat:
  // `parts` over the same input, outputs concatenated (a merged projection whose parts a GGUF file
  // stores in different types, e.g. q/k Q4_K beside v Q6_K).
  // kFp8: e4m3 bytes [N, K] with fp32 scales [N, ceil(K / group_size)] (kvflow/quant/fp8.py).
  enum class Kind { kBf16, kInt8, kInt4, kGgml, kConcat, kFp8 };
  Kind kind;
  at::Tensor weight;  // bf16 tiles [N_pad / 16, K / 2, 16, 2] | int8 tiles [N_pad / 16, K_pad / 4, 16, 4] | int4
                         // tiles [N_pad / 16, 8K]
  at::Tensor packed;  // bf16 only, rows > max_gemv_rows: oneDNN's blocked copy, or the plain [N, K] weight
                         // where oneDNN has no bf16 GEMM (AVX2 CPUs: multiplied in fp32)
  bool packed_is_blocked = true;
  at::Tensor scales;  // int8 [N] fp32 | int4 [N_pad / 16, K / g, 16] bf16
  at::Tensor mins;    // int4 [N_pad / 16, K / g, 16] bf16
  c10::optional<at::Tensor> bias;
  c10::optional<at::Tensor> perm;  // int4 act-order: input permutation [K]
  int64_t ggml_type = 0;              // kGgml
  at::Tensor supers;               // kGgml K-quants: fp16 super-block scales
  std::vector<std::shared_ptr<NativeLinear>> parts;  // kConcat
  int64_t group_size = 0;
  int64_t out_features = 0, in_features = 0;
  // Rows up to which the GEMV runs (beyond: oneDNN / dequantize-and-GEMM tiles). Batch-invariant
  // mode sets it unbounded: the GEMVs' rows do not depend on each other.
  int64_t max_gemv_rows = 32;  // kvflow/layers/linear.py SKINNY_MAX_ROWS (the modules hand theirs over)

  at::Tensor forward(const at::Tensor& x) const;  // [M, K] bf16 -> [M, N] bf16
  // [M, K] bf16 -> [M] int64: each row's argmax of forward(x) (the first index of its maximum),
  // folded into the GEMV's tiles as they are written (argmax_lanes.h) up to max_gemv_rows.
  at::Tensor greedy(const at::Tensor& x) const;
};

// One layer's KV pools (kvflow/attention/kv_layer.py): "plain" (bf16) or int8 / fp8_e4m3 / int4.
struct NativeKVLayer {
  std::string kind;
  at::Tensor key_data, value_data;    // plain: the bf16 pools [S, Hkv, D]
  at::Tensor key_scale, value_scale;  // quantized: fp16 [S, Hkv]
  at::Tensor key_zero, value_zero;    // int4: fp16 [S, Hkv]; otherwise the scales (unread)
  int64_t num_kv_heads = 0, head_dim = 0;

  void write_row(bool is_key, int64_t slot, int64_t head, const float* x) const;
  at::Tensor attend(const at::Tensor& q, const at::Tensor& kv_slots, const at::Tensor& num_keys,
                       double scale) const;
};

struct NativeDecoderLayer {
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;
  std::shared_ptr<NativeLinear> qkv, o, gate_up, down;
};

// The pieces of one decoder layer that NativeDecoder::forward_profiled times, in execution order
// (kDecodePieceNames names them for Python). Residual pieces include a tensor-parallel all-reduce.
enum DecodePiece : int {
  kInputNorm,
  kQkvProj,
  kRopeKvWrite,  // Qwen3's q/k norms, RoPE, the K/V write into the pool
  kAttention,
  kOProj,
  kResidualPostNorm,
  kGateUpProj,
  kSiluAndMul,
  kDownProj,
  kResidual,
  kFinalNorm,  // once per step, after the last layer
  kNumDecodePieces,
};
extern const char* const kDecodePieceNames[kNumDecodePieces];

struct NativeDecoder {
  std::vector<NativeDecoderLayer> layers;
  std::vector<NativeKVLayer> kv_layers;
  at::Tensor final_norm;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double eps = 1e-6;
  // Tensor parallelism (kvflow/parallel/): sums a row-parallel output (o_proj, down_proj) over the
  // ranks in place before the residual add; unset in one process.
  std::function<void(at::Tensor&)> all_reduce;

  // Paging and RoPE for forward_rows (set_paging): cos and sign-folded sin of every position, bf16
  // [P, D] (kvflow/layers/rotary.py RotaryEmbedding.tables); the KV pools' block size; the sliding
  // window in tokens, 0 for none.
  at::Tensor rope_cos, rope_sin_signed;
  int64_t block_size = 0, sliding_window = 0;
  // The token embedding table, bf16 [V, H] (set_embedding), for forward_rows to look rows up itself;
  // undefined where the lookup is not a plain gather (a tensor-parallel vocabulary shard).
  at::Tensor embedding;

  // Embedded hidden [M, H] -> final-normed hidden [M, H]; writes each row's K/V at slot_mapping.
  at::Tensor forward(at::Tensor hidden, at::Tensor cos, at::Tensor sin_signed, at::Tensor slot_mapping,
                        at::Tensor kv_slots, at::Tensor num_keys) const;
  // forward from each row's query position and block table (kvflow/worker/input_batch.py DecodeRows):
  // the RoPE rows, the K/V slot, the key slots and counts are derived here, as build_input_batch
  // derives them in Python, so that a decode step hands over plain lists instead of building six
  // tensors (each a trip through the dispatcher with the caches cold after the previous step).
  // hidden [M, H], or none: the rows of `embedding` at token_ids.
  at::Tensor forward_rows(c10::optional<at::Tensor> hidden, const std::vector<int64_t>& token_ids,
                             const std::vector<int64_t>& positions,
                             const std::vector<std::vector<int64_t>>& block_tables) const;
  // forward, and the wall time of each DecodePiece summed over the layers: float64 [kNumDecodePieces]
  // in microseconds. The same calls in the same order (the same numbers); a clock read between pieces.
  std::tuple<at::Tensor, at::Tensor> forward_profiled(at::Tensor hidden, at::Tensor cos,
                                                           at::Tensor sin_signed, at::Tensor slot_mapping,
                                                           at::Tensor kv_slots, at::Tensor num_keys) const;

 private:
  // piece_us: null (no clock reads) or [kNumDecodePieces] accumulators.
  at::Tensor run(at::Tensor hidden, at::Tensor cos, at::Tensor sin_signed, const at::Tensor& slot_mapping,
                    const at::Tensor& kv_slots, const at::Tensor& num_keys, double* piece_us) const;
};

}  // namespace kvflow
