"""Architecture name (config.json `architectures`) -> model class.

One class covers the four dense families (the differences are config switches, see
arch_config.py); a family with a different block structure gets its own class here: the
mixture-of-experts ones (kvflow/models/moe.py) and DeepSeek's latent attention
(kvflow/models/deepseek_v2.py).
"""

from __future__ import annotations

from kvflow.arch_config import DENSE_ARCHITECTURES
from kvflow.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.models.moe import MixtralForCausalLM, MoEForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaFamilyForCausalLM]] = {
    **dict.fromkeys(DENSE_ARCHITECTURES, LlamaFamilyForCausalLM),
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,  # V3 differs by config switches only
}
