"""Swap a loaded model's linear layers for quantized ones (the gpt-fast way: at load, not in forward)."""

from __future__ import annotations

import logging

from torch import nn

from kvflow.config import QuantConfig
from kvflow.layers.linear import Linear
from kvflow.quant.linear import Int4Linear, Int8Linear
from kvflow.quant.weights import quantize_int4, quantize_int8

logger = logging.getLogger("kvflow")


def quantize_linear(linear: Linear, config: QuantConfig) -> nn.Module:
    weight, bias = linear.weight.data, None if linear.bias is None else linear.bias.data
    if config.quantization == "int8":
        return Int8Linear(quantize_int8(weight), bias, weight.dtype)
    return Int4Linear(quantize_int4(weight, config.quantization_group_size), bias, weight.dtype)


def quantize_model(model: nn.Module, config: QuantConfig) -> None:
    """Replace every `Linear` of the decoder layers (and the LM head if asked) in place; call before
    `prepare_for_inference`, which then packs only what stayed in the model dtype."""
    if not config.enabled:
        return
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or (name == "lm_head" and not config.quantize_lm_head):
                continue
            setattr(parent, name, quantize_linear(child, config))
            replaced += 1
    head = "quantized" if config.quantize_lm_head else "kept in the model dtype"
    logger.info("%s weights: %d linear layers quantized; LM head %s", config.quantization, replaced, head)
