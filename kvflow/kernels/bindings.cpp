// Python bindings of kvflow's native CPU kernels (one extension, built once by kvflow/kernels).
#include <torch/extension.h>

torch::Tensor skinny_linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                                          torch::Tensor slots, torch::Tensor seq_lens, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear_bf16", &skinny_linear_bf16, "y = x @ W^T (+ b) for few rows x, bf16 (AVX512-BF16)");
  m.def("paged_decode_attention_bf16", &paged_decode_attention_bf16,
        "single-query attention over the paged bf16 KV pool, GQA-aware");
}
