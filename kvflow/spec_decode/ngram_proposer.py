"""N-gram prompt lookup (no extra model): propose the tokens that followed the most recent earlier
occurrence of the request's last n tokens, trying n from `max_n` down to `min_n`.

Pure Python over the request's token ids (prompt + output). It pays off when outputs copy from the
prompt (code edits, extraction, summaries quoting the source) and costs one lookup per step.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(
    token_ids: Sequence[int], num_speculative_tokens: int, min_n: int = 1, max_n: int = 4
) -> list[int]:
    """Up to `num_speculative_tokens` drafts, or [] when no n-gram of the suffix recurs."""
    if num_speculative_tokens <= 0:
        return []
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(token_ids[length - n :])
        # The most recent earlier occurrence: scan right to left, excluding the suffix itself.
        for start in range(length - n - 1, -1, -1):
            if list(token_ids[start : start + n]) == suffix:
                follow = token_ids[start + n : start + n + num_speculative_tokens]
                if follow:
                    return list(follow)
                break
    return []
