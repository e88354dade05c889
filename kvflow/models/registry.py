"""Architecture name (config.json `architectures`) -> model class.

One class covers the four supported families (the differences are config switches, see
arch_config.py); a new family with a different block structure gets its own class here.
"""

from __future__ import annotations

from kvflow.arch_config import SUPPORTED_ARCHITECTURES
from kvflow.models.llama import LlamaFamilyForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaFamilyForCausalLM]] = dict.fromkeys(
    SUPPORTED_ARCHITECTURES, LlamaFamilyForCausalLM
)
