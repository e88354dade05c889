"""kvflow doctor: the six-step latency diagnosis (input, TTFT, ITL, KV memory, quantization, serving
features) from a benchmark run and a model's config.json, with quantified what-ifs."""
