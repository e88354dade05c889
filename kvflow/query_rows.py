"""Which scheduled chunks the worker attends as single-token query rows (torch-free: the engine's
step statistics and the doctor's step cost need the rule, and neither imports the worker).

A chunk of at most MAX_QUERY_ROWS_PER_CHUNK tokens (a decode, a speculative step's k + 1
verification tokens, a prompt's short suffix after a prefix-cache hit) is attended as that many
single-token query rows, each re-reading its whole context through the decode path; a longer chunk
is one prefill-attention call (kvflow/worker/input_batch.py). So a row's cost grows with the keys it
reads, not with the queries x keys a prefill chunk computes in one pass: an 8-token suffix after 768
cached tokens is 8 decode rows at context ~770, not a small prompt chunk.
"""

from __future__ import annotations

# Chunks up to this many tokens are query rows: a speculative step's k + 1 tokens for any k used in
# practice; longer chunks are prefill, where one flash-attention call per chunk
# (kvflow/kernels/prefill_attention.cpp) beats re-reading the context once per query row.
MAX_QUERY_ROWS_PER_CHUNK = 8


def is_query_row_chunk(num_tokens: int) -> bool:
    """Whether a chunk of `num_tokens` scheduled tokens is attended as single-token query rows."""
    return num_tokens <= MAX_QUERY_ROWS_PER_CHUNK
