"""kvflow: an LLM inference engine that measures and explains its own latency.

The public names are imported lazily (PEP 562) so that `import kvflow.engine.scheduler` and the
other pure-Python bookkeeping modules never pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.llm import LLM
    from kvflow.outputs import RequestOutput
    from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

from kvflow.version import __version__

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "__version__"]

_LOCATIONS = {
    "LLM": "kvflow.llm",
    "EngineConfig": "kvflow.config",
    "RequestOutput": "kvflow.outputs",
    "SamplingParams": "kvflow.sampling_params",
    "StructuredOutputsParams": "kvflow.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LOCATIONS:
        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
