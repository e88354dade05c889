// Python bindings of kvflow's native CPU kernels (one extension, built once by kvflow/kernels).
// torch's pybind11 casters for tensors (torch/csrc/utils/pybind.h, ~6 s to parse), not
// <torch/extension.h>, which adds the whole C++ frontend (~19 s): this unit was the build's long pole.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "decode_forward.h"

at::Tensor empty_huge_pages(int64_t nbytes);

at::Tensor prefill_attention_bf16(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                     at::Tensor slots, double scale, c10::optional<at::Tensor> sinks);

namespace py = pybind11;
using kvflow::NativeDecoder;
using kvflow::NativeDecoderLayer;
using kvflow::NativeKVLayer;
using kvflow::NativeLinear;
using OptTensor = c10::optional<at::Tensor>;

namespace {

std::shared_ptr<NativeLinear> make_linear(NativeLinear::Kind kind, at::Tensor weight, int64_t in_features) {
  auto linear = std::make_shared<NativeLinear>();
  linear->kind = kind;
  linear->weight = weight.contiguous();
  linear->out_features = weight.size(0);
  linear->in_features = in_features;
  return linear;
}

void bind_decode_forward(py::module& m) {
  py::class_<NativeLinear, std::shared_ptr<NativeLinear>>(m, "NativeLinear")
      .def_static(
          "bf16",
          [](at::Tensor tiles, at::Tensor packed, bool packed_is_blocked, int64_t out_features, OptTensor bias,
             int64_t max_gemv_rows) {
            auto l = make_linear(NativeLinear::Kind::kBf16, tiles, tiles.size(1) * 2);
            l->out_features = out_features;
            l->packed = packed;
            l->packed_is_blocked = packed_is_blocked;
            l->bias = bias;
            l->max_gemv_rows = max_gemv_rows;
            return l;
          },
          "bf16 16-row tiles (tile_bf16_weight), the oneDNN-blocked weight (or the plain one), whether it is "
          "blocked, N, bias, GEMV row limit")
      .def_static(
          "int8",
          [](at::Tensor tiles, at::Tensor scales, int64_t in_features, OptTensor bias, int64_t max_gemv_rows) {
            auto l = make_linear(NativeLinear::Kind::kInt8, tiles, in_features);
            l->out_features = scales.numel();
            l->scales = scales.contiguous();
            l->bias = bias;
            l->max_gemv_rows = max_gemv_rows;
            return l;
          },
          "int8 16-row tiles (pack_int8_tiles), fp32 row scales [N], K, optional bias, GEMV row limit")
      .def_static(
          "int4",
          [](at::Tensor packed, at::Tensor scales, at::Tensor mins, int64_t group_size, int64_t out_features,
             OptTensor bias, OptTensor perm, int64_t max_gemv_rows) {
            auto l = make_linear(NativeLinear::Kind::kInt4, packed, packed.size(1) / 8);
            l->out_features = out_features;
            l->max_gemv_rows = max_gemv_rows;
            l->scales = scales.contiguous();
            l->mins = mins.contiguous();
            l->group_size = group_size;
            l->bias = bias;
            l->perm = perm;
            return l;
          },
          "int4 16-row tiles [N_pad / 16, 8K], bf16 scales/mins [N_pad / 16, K / g, 16], g, N, bias, perm, GEMV rows")
      .def_static(
          "ggml",
          [](int64_t ggml_type, at::Tensor values, at::Tensor scales, at::Tensor mins, at::Tensor supers,
             int64_t in_features, int64_t out_features, OptTensor bias, int64_t max_gemv_rows) {
            auto l = make_linear(NativeLinear::Kind::kGgml, values, in_features);
            l->ggml_type = ggml_type;
            l->out_features = out_features;
            l->scales = scales.contiguous();
            l->mins = mins.contiguous();
            l->supers = supers.contiguous();
            l->bias = bias;
            l->max_gemv_rows = max_gemv_rows;
            return l;
          },
          "a GGUF block type by its ggml type id (kvflow/quant/gguf_linear.py's tiles and params), K, N, bias, GEMV rows")
      .def_static(
          "fp8",
          [](at::Tensor q, at::Tensor scales, int64_t block, OptTensor bias) {
            auto l = make_linear(NativeLinear::Kind::kFp8, q, q.size(1));
            l->scales = scales.contiguous();
            l->group_size = block;
            l->bias = bias;
            return l;
          },
          "FP8 e4m3 bytes [N, K], fp32 scales [N, ceil(K / block)], block, bias (gemv_fp8.cpp)")
      .def_static(
          "concat",
          [](std::vector<std::shared_ptr<NativeLinear>> parts) {
            TORCH_CHECK(!parts.empty(), "concat of no linears");
            auto l = std::make_shared<NativeLinear>();
            l->kind = NativeLinear::Kind::kConcat;
            l->in_features = parts[0]->in_features;
            for (const auto& p : parts) l->out_features += p->out_features;
            l->parts = std::move(parts);
            return l;
          },
          "linears over the same input, outputs concatenated")
      .def("forward", &NativeLinear::forward, py::call_guard<py::gil_scoped_release>())
      .def("greedy", &NativeLinear::greedy, py::call_guard<py::gil_scoped_release>(),
           "x [M, K] -> [M] int64: each row's argmax of forward(x), taken as the GEMV writes it");

  py::class_<NativeDecoder, std::shared_ptr<NativeDecoder>>(m, "NativeDecoder")
      .def(py::init([](int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, at::Tensor final_norm) {
        auto d = std::make_shared<NativeDecoder>();
        d->num_heads = num_heads;
        d->num_kv_heads = num_kv_heads;
        d->head_dim = head_dim;
        d->eps = eps;
        d->final_norm = final_norm;
        return d;
      }))
      .def(
          "add_layer",
          [](NativeDecoder& d, at::Tensor input_norm, at::Tensor post_norm, OptTensor q_norm, OptTensor k_norm,
             std::shared_ptr<NativeLinear> qkv, std::shared_ptr<NativeLinear> o, std::shared_ptr<NativeLinear> gate_up,
             std::shared_ptr<NativeLinear> down, const std::string& kv_kind, std::vector<at::Tensor> kv_tensors) {
            TORCH_CHECK(kv_tensors.size() == 6, "kv tensors: key data, value data, key/value scale, key/value zero");
            NativeKVLayer kv{kv_kind,       kv_tensors[0], kv_tensors[1], kv_tensors[2], kv_tensors[3],
                             kv_tensors[4], kv_tensors[5], d.num_kv_heads, d.head_dim};
            d.layers.push_back({input_norm, post_norm, q_norm, k_norm, qkv, o, gate_up, down});
            d.kv_layers.push_back(kv);
          },
          "one decoder layer: norms, linears, and its KV pools (kind 'plain' or a quantized KV dtype)")
      .def(
          "set_all_reduce",
          [](NativeDecoder& d, py::function fn) {
            // Called from forward (GIL released): the callable runs under the GIL, in place.
            d.all_reduce = [fn](at::Tensor& t) {
              py::gil_scoped_acquire gil;
              fn(t);
            };
          },
          "tensor parallelism: fn(tensor) sums a row-parallel output over the ranks in place")
      .def(
          "set_paging",
          [](NativeDecoder& d, at::Tensor rope_cos, at::Tensor rope_sin_signed, int64_t block_size,
             int64_t sliding_window) {
            TORCH_CHECK(rope_cos.dtype() == at::kBFloat16 && rope_sin_signed.dtype() == at::kBFloat16 &&
                            rope_cos.dim() == 2 && rope_cos.size(1) == d.head_dim &&
                            rope_sin_signed.sizes() == rope_cos.sizes(),
                        "bf16 RoPE tables [P, head_dim]");
            TORCH_CHECK(block_size > 0 && sliding_window >= 0, "block_size > 0, sliding_window >= 0 (0: none)");
            d.rope_cos = rope_cos.contiguous();
            d.rope_sin_signed = rope_sin_signed.contiguous();
            d.block_size = block_size;
            d.sliding_window = sliding_window;
          },
          "forward_rows' inputs: RoPE cos / sign-folded sin tables [P, D] bf16, block size, sliding window (0: none)")
      .def(
          "set_embedding",
          [](NativeDecoder& d, at::Tensor embedding) {
            TORCH_CHECK(embedding.dtype() == at::kBFloat16 && embedding.dim() == 2, "bf16 [V, H] embedding table");
            d.embedding = embedding.contiguous();
          },
          "the token embedding table [V, H] bf16, for forward_rows without hidden")
      .def_property_readonly(
          "has_embedding", [](const NativeDecoder& d) { return d.embedding.defined(); },
          "whether forward_rows can look the embedding rows up itself (set_embedding)")
      .def("forward_rows", &NativeDecoder::forward_rows, py::call_guard<py::gil_scoped_release>(),
           "hidden [M, H] or None (the embedding's rows), token ids, query positions, block tables -> normed hidden")
      .def("forward", &NativeDecoder::forward, py::call_guard<py::gil_scoped_release>(),
           "hidden [M, H], cos/sin_signed [M, D], slot_mapping [M], kv_slots [M, L], num_keys [M] -> normed hidden")
      .def("forward_profiled", &NativeDecoder::forward_profiled, py::call_guard<py::gil_scoped_release>(),
           "forward's arguments -> (normed hidden, float64 [pieces] microseconds of each piece summed over layers)")
      .def_property_readonly_static(
          "piece_names",
          [](py::object) {
            return std::vector<std::string>(kvflow::kDecodePieceNames,
                                            kvflow::kDecodePieceNames + kvflow::kNumDecodePieces);
          },
          "names of forward_profiled's pieces, in its order");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tile_bf16_weight", &tile_bf16_weight, "W [N, K] bf16 -> 16-row tiles [N_pad / 16, K / 2, 16, 2]");
  m.def("skinny_linear_bf16", &skinny_linear_bf16, "y = x @ W^T (+ b) for few rows x, bf16 16-row tiles");
  // The attention kernels take optional sink logits [Hq] fp32 last (attention_sinks.h); None: none.
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16,
        "single-query attention over the paged bf16 KV pool, GQA-aware", py::arg("q"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("slots"), py::arg("seq_lens"), py::arg("scale"), py::arg("sinks") = py::none());
  m.def("paged_decode_attention_quantized", &paged_decode_attention_quantized,
        "single-query attention over a paged int8 / fp8_e4m3 / int4 KV pool, dequantized as read", py::arg("q"),
        py::arg("k_data"), py::arg("k_scale"), py::arg("k_zero"), py::arg("v_data"), py::arg("v_scale"),
        py::arg("v_zero"), py::arg("slots"), py::arg("seq_lens"), py::arg("scale"), py::arg("kind"),
        py::arg("sinks") = py::none());
  m.def("prefill_attention_bf16", &prefill_attention_bf16,
        "causal attention of a prefill chunk over its keys in the paged bf16 KV pool (flash style)", py::arg("q"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slots"), py::arg("scale"), py::arg("sinks") = py::none());
  m.def("skinny_linear_int8", &skinny_linear_int8, "y = x @ (q * s)^T (+ b) for few rows x, int8 16-row tiles");
  m.def("skinny_linear_fp8", &skinny_linear_fp8, "y = x @ W^T (+ b) for few rows x, W e4m3 bytes x block scales",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("block"), py::arg("bias") = py::none());
  m.def("skinny_linear_int4", &skinny_linear_int4, "y = x @ W^T (+ b) for few rows x, int4 group-wise weights");
  m.def("dequantize_int4_rows", &dequantize_int4_rows, "rows [n_begin, n_end) of q * s + z as bf16 (n_begin % 16 == 0)");
  m.def("dequantize_int8_rows", &dequantize_int8_rows, "rows [n_begin, n_end) of q * s as bf16 (n_begin % 16 == 0)");
  m.def("skinny_linear_q8_0", &skinny_linear_q8_0, "y = x @ W^T (+ b), W Q8_0 on int8 tiles with fp16 block scales",
        py::arg("x"), py::arg("tiles"), py::arg("block_scales"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("dequantize_q8_0_rows", &dequantize_q8_0_rows, "rows [n_begin, n_end) of a Q8_0 weight as bf16");
  m.def("skinny_linear_ggml", &skinny_linear_ggml, "y = x @ W^T (+ b), W a ggml 4/5/6-bit block type on 16-row tiles",
        py::arg("x"), py::arg("ggml_type"), py::arg("values"), py::arg("scales"), py::arg("mins"), py::arg("supers"),
        py::arg("out_features"), py::arg("bias") = py::none());
  m.def("dequantize_ggml_rows", &dequantize_ggml_rows, "rows [n_begin, n_end) of a ggml block-type weight as bf16");
  m.def("rms_norm_bf16", &rms_norm_bf16, "y = x * rsqrt(mean(x^2) + eps) * w over bf16 rows, one rounding");
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16, "silu(gate) * up over bf16 [gate | up] rows");
  m.def("argmax_rows", &argmax_rows, "the first index of each row's maximum (torch.argmax(logits, -1))");
  m.def("empty_huge_pages", &empty_huge_pages, "an uninitialised [nbytes] uint8 buffer on 2 MiB transparent huge pages");
  bind_decode_forward(m);
}
