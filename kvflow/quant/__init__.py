"""Weight-only quantization (int8 per channel, int4 group-wise) and its quality measurement."""
