// Python bindings of kvflow's native CPU kernels (one extension, built once by kvflow/kernels).
#include <torch/extension.h>

torch::Tensor skinny_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                          torch::Tensor slots, torch::Tensor seq_lens, double scale);
torch::Tensor paged_decode_attention_quantized(torch::Tensor q, torch::Tensor k_data, torch::Tensor k_scale,
                                               torch::Tensor k_zero, torch::Tensor v_data, torch::Tensor v_scale,
                                               torch::Tensor v_zero, torch::Tensor slots, torch::Tensor seq_lens,
                                               double scale, const std::string& kind);
torch::Tensor skinny_linear_int8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                                 c10::optional<torch::Tensor> bias);
torch::Tensor skinny_linear_int4(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                                 int64_t group_size, c10::optional<torch::Tensor> bias);
torch::Tensor dequantize_int4_rows(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins,
                                   int64_t group_size, int64_t n_begin, int64_t n_end);
torch::Tensor dequantize_int8_rows(torch::Tensor qweight, torch::Tensor scales, int64_t n_begin, int64_t n_end);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear_bf16", &skinny_linear_bf16, "y = x @ W^T (+ b) for few rows x, bf16 (AVX512-BF16)");
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16,
        "single-query attention over the paged bf16 KV pool, GQA-aware");
  m.def("paged_decode_attention_quantized", &paged_decode_attention_quantized,
        "single-query attention over a paged int8 / fp8_e4m3 / int4 KV pool, dequantized as read");
  m.def("skinny_linear_int8", &skinny_linear_int8, "y = x @ (q * s)^T (+ b) for few rows x, int8 weights");
  m.def("skinny_linear_int4", &skinny_linear_int4, "y = x @ W^T (+ b) for few rows x, int4 group-wise weights");
  m.def("dequantize_int4_rows", &dequantize_int4_rows, "rows [n_begin, n_end) of q * s + z as bf16");
  m.def("dequantize_int8_rows", &dequantize_int8_rows, "rows [n_begin, n_end) of q * s as bf16");
}
