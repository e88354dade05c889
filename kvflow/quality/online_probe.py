"""Online quality probe: while serving quantized, score a sample of finished requests against the
unquantized model, so the quality cost shows on a dashboard rather than only in an offline eval.

With probability `rate` a finished request's tokens (prompt + output, the first `max_tokens`) are
queued; a background thread scores them teacher-forced with the serving model (its quantized
weights and KV dtype) and with an unquantized copy of the weights, and keeps running totals of
the quant-eval figures: mean KL(reference || served), top-1 agreement, and each path's perplexity.
Costs: a second copy of the weights in the model dtype, and CPU time on the probe thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
from collections.abc import Callable

import torch

from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.outputs import RequestOutput
from kvflow.quality.teacher_forcing import QualityTotals, window_log_probs

logger = logging.getLogger(__name__)

DEFAULT_PROBE_TOKENS = 256
MAX_QUEUED_PROBES = 8  # beyond this, samples are dropped: the probe must never grow memory


class QualityProbe:
    def __init__(
        self,
        served: LlamaFamilyForCausalLM,
        reference: LlamaFamilyForCausalLM,
        kv_cache_dtype: str,
        rate: float,
        on_update: Callable[[dict[str, float]], None],
        max_tokens: int = DEFAULT_PROBE_TOKENS,
        seed: int = 0,
    ) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"quality_probe_rate must be in (0, 1], got {rate}")
        self.served, self.reference = served, reference
        self.kv_cache_dtype = kv_cache_dtype
        self.rate = rate
        self.max_tokens = max_tokens
        self.on_update = on_update
        self.totals = QualityTotals()
        self._rng = random.Random(seed)
        self._queue: queue.Queue[list[int] | None] = queue.Queue(MAX_QUEUED_PROBES)
        self._thread = threading.Thread(target=self._run, name="kvflow-quality-probe", daemon=True)
        self._thread.start()

    def offer(self, output: RequestOutput) -> None:
        """Engine thread: maybe sample a finished request (never blocks)."""
        if not output.finished or output.error is not None or self._rng.random() >= self.rate:
            return
        ids = (list(output.prompt_token_ids) + list(output.outputs[0].token_ids))[: self.max_tokens]
        if len(ids) < 2:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(ids)

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def _run(self) -> None:
        while (ids := self._queue.get()) is not None:
            try:
                self._score(ids)
            except Exception:  # the probe must never take serving down
                logger.exception("quality probe failed")

    def _score(self, ids: list[int]) -> None:
        inputs, targets = ids[:-1], torch.tensor(ids[1:])
        reference = window_log_probs(self.reference, inputs)
        served = window_log_probs(self.served, inputs, self.kv_cache_dtype)
        self.totals.add(reference, served, targets)
        self.on_update(self.totals.snapshot())
