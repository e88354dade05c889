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
    """Up to `num_speculative_tokens` drafts, or [] when no n-gram of the suffix recurs.

    The longest recurring suffix n-gram (n <= max_n) wins, and among its occurrences the most
    recent. One right-to-left pass over the positions holding the last token, each extended
    backwards: O(context) comparisons of ints, not O(context x n) slices (this runs every step
    for every request, and a step of a small model takes a few milliseconds).
    """
    if num_speculative_tokens <= 0:
        return []
    ids = token_ids if isinstance(token_ids, list) else list(token_ids)
    length = len(ids)
    last = length - 1
    best_n, best_end = 0, -1
    for end in range(last - 1, -1, -1):  # `end`: where an earlier occurrence of the suffix ends
        if ids[end] != ids[last]:
            continue
        n = 1
        while n < max_n and n <= end and ids[end - n] == ids[last - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return ids[best_end + 1 : best_end + 1 + num_speculative_tokens]
