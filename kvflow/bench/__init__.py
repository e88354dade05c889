"""kvflow bench: a load generator that measures TTFT, ITL and TPOT against any OpenAI-compatible server."""
