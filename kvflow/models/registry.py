"""Architecture name (config.json `architectures`) -> model class.

One class covers the four dense families (the differences are config switches, see
arch_config.py); a family with a different block structure gets its own class here: the
mixture-of-experts ones (kvflow/models/moe.py) and DeepSeek's latent attention
(kvflow/models/deepseek_v2.py), and the families mixing cache kinds (gpt_oss.py, gemma3.py,
qwen3_next.py).
"""

from __future__ import annotations

from kvflow.arch_config import DENSE_ARCHITECTURES
from kvflow.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvflow.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvflow.models.gemma3 import Gemma3ForCausalLM
from kvflow.models.gpt_oss import GptOssForCausalLM
from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.models.moe import MixtralForCausalLM, MoEForCausalLM
from kvflow.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaFamilyForCausalLM]] = {
    **dict.fromkeys(DENSE_ARCHITECTURES, LlamaFamilyForCausalLM),
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,  # V3 differs by config switches only
    "DeepseekV32ForCausalLM": DeepseekV2ForCausalLM,  # V3 + the lightning indexer (DSA)
    # Families mixing cache kinds (kvflow/kv_cache/): sliding + full, linear attention + full.
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    # Compressed sparse / heavily compressed attention over a window (kvflow/kv_cache/compressed_kinds.py).
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
}
