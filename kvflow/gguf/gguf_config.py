"""A GGUF file's metadata as the Hugging Face config.json it was converted from.

llama.cpp's converter (convert_hf_to_gguf.py) writes each architecture's hyperparameters under
`{arch}.*` keys; this inverts that for the architectures kvflow runs, so the rest of kvflow parses
one config format (kvflow/arch_config.py):
    general.architecture      llama (Llama, Mistral), qwen2, qwen3, qwen3moe, gpt-oss
    {arch}.embedding_length   hidden_size           {arch}.block_count           num_hidden_layers
    {arch}.feed_forward_length intermediate_size    {arch}.context_length        max_position_embeddings
    {arch}.attention.head_count / head_count_kv / key_length / layer_norm_rms_epsilon
    {arch}.rope.freq_base     rope_theta            {arch}.rope.scaling.*        rope_scaling (linear, yarn)
    {arch}.expert_count / expert_used_count / expert_feed_forward_length (qwen3moe)
    tensor rope_freqs.weight  Llama 3.1's per-frequency divisors (its "llama3" rope_scaling, which
                              the converter bakes into a tensor): rope_type "freq_factors"
    no tensor output.weight   tie_word_embeddings
    tensor blk.0.attn_q.bias  attention_bias
    the token_embd rows       vocab_size (the file's metadata may omit it)
The dtype the file "is" (config.json's torch_dtype) is float32 for an all-F32 file and bfloat16
otherwise: the quantized and 16-bit types compute in bf16 on kvflow's kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvflow.errors import ModelLoadError
from kvflow.gguf.gguf_file import GGUFFile

# general.architecture -> the Hugging Face architecture kvflow's registry runs.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama 1-3 and Mistral 7B (llama.cpp converts both to "llama")
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# gpt-oss's fixed settings that its GGUF files do not carry (llama.cpp's gpt-oss graph hard-codes
# them too): the SwiGLU clamp, and YaRN without rounding its correction range (the released
# config.json's rope_scaling.truncate false). Sliding and full layers alternate, sliding first
# (kvflow/arch_kinds.py's default, llama.cpp's swa pattern of 2).
GPT_OSS_SWIGLU_LIMIT = 7.0
# Architectures whose converter permutes the rows of attn_q / attn_k into ggml's interleaved rope
# order (rope type NORM); the loader permutes them back (kvflow/models/gguf_loader.py).
PERMUTED_QK_ARCHITECTURES = ("llama",)
ROPE_FREQS_TENSOR = "rope_freqs.weight"
_ALL_F32_FILE_TYPE = 0  # general.file_type of a file whose tensors are all float32 (LLAMA_FTYPE_ALL_F32)
_DEFAULT_CONTEXT = 2048


def gguf_hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """config.json's fields for the file's model (module docstring)."""
    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; kvflow runs GGUF files of "
            f"{', '.join(GGUF_ARCHITECTURES)} (other models: use their Hugging Face checkpoint)"
        )
    hidden = int(gguf.arch_field("embedding_length"))
    heads = int(gguf.arch_field("attention.head_count"))
    embed = gguf.tensor("token_embd.weight")
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(gguf.arch_field("feed_forward_length", 0)),
        "num_hidden_layers": int(gguf.arch_field("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.arch_field("attention.head_count_kv", heads)),
        "head_dim": int(gguf.arch_field("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(gguf.arch_field("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(gguf.arch_field("context_length", _DEFAULT_CONTEXT)),
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "rope_parameters": _rope_parameters(gguf),
        "torch_dtype": "float32"
        if gguf.field("general.file_type", None) == _ALL_F32_FILE_TYPE
        else "bfloat16",
        "hidden_act": "silu",
    }
    # q/k/v/o biases where the file has them (gpt-oss; Qwen2's q/k/v come with its architecture).
    cfg["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    if arch == "gpt-oss":
        cfg.update(
            intermediate_size=int(gguf.arch_field("expert_feed_forward_length")),
            num_local_experts=int(gguf.arch_field("expert_count")),
            num_experts_per_tok=int(gguf.arch_field("expert_used_count")),
            sliding_window=int(gguf.arch_field("attention.sliding_window")),
            swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
        )
        if cfg["rope_parameters"]["rope_type"] == "yarn":
            cfg["rope_parameters"]["truncate"] = False
    if arch == "qwen3moe":
        cfg.update(
            num_experts=int(gguf.arch_field("expert_count")),
            num_experts_per_tok=int(gguf.arch_field("expert_used_count")),
            moe_intermediate_size=int(gguf.arch_field("expert_feed_forward_length")),
            # llama.cpp's qwen3moe graph always renormalises the top-k weights.
            norm_topk_prob=True,
        )
    cfg.update(_token_ids(gguf))
    return cfg


def _rope_parameters(gguf: GGUFFile) -> dict[str, Any]:
    theta = float(gguf.arch_field("rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if ROPE_FREQS_TENSOR in gguf.tensors:
        factors = gguf.tensors[ROPE_FREQS_TENSOR]
        if factors.type_name != "F32":
            raise ModelLoadError(
                f"{gguf.path}: tensor {ROPE_FREQS_TENSOR!r} is {factors.type_name}, expected F32"
            )
        rope.update(
            rope_type="freq_factors", freq_factors=np.asarray(factors.data, dtype=np.float32).tolist()
        )
        return rope
    scaling = str(gguf.arch_field("rope.scaling.type", "none"))
    if scaling == "none":
        return rope
    if scaling not in ("linear", "yarn"):
        raise ModelLoadError(f"{gguf.path}: rope.scaling.type {scaling!r} is not supported (linear, yarn)")
    rope.update(rope_type=scaling, factor=float(gguf.arch_field("rope.scaling.factor")))
    original = gguf.arch_field("rope.scaling.original_context_length", None)
    if original is not None:
        rope["original_max_position_embeddings"] = int(original)
    return rope


def _token_ids(gguf: GGUFFile) -> dict[str, Any]:
    ids = {}
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        value = gguf.field(f"tokenizer.ggml.{name}_token_id", None)
        if value is not None:
            ids[key] = int(value)
    return ids
