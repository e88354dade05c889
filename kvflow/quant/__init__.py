"""Weight-only quantization: int8 per channel, int4 group-wise, and GPTQ/AWQ/compressed-tensors
checkpoints unpacked at load (their quality cost is measured by kvflow/quality/)."""
