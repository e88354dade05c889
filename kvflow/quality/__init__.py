"""How close a quantized path stays to the unquantized one: teacher-forced KL, top-1 agreement and
perplexity, offline (`kvflow quant-eval`) and online while serving (`--quality-probe-rate`)."""
