"""Transformers' progress bars, silenced while tools/train_tiny.py and the test fixtures write checkpoints."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def hf_progress_bars_disabled() -> Iterator[None]:
    """Silence transformers' "Writing model shards" bars, which clutter logs and break our own bars."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
