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
import math
import queue
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.outputs import RequestOutput
from kvflow.quant.scoring import window_log_probs

logger = logging.getLogger(__name__)

DEFAULT_PROBE_TOKENS = 256
MAX_QUEUED_PROBES = 8  # beyond this, samples are dropped: the probe must never grow memory


@dataclass
class ProbeTotals:
    positions: int = 0
    kl_sum: float = 0.0
    agree: int = 0
    nll_reference: float = 0.0
    nll_served: float = 0.0

    def snapshot(self) -> dict[str, float]:
        n = max(self.positions, 1)
        return {
            "positions": float(self.positions),
            "mean_kl": self.kl_sum / n,
            "top1_agreement": self.agree / n,
            "perplexity_reference": math.exp(self.nll_reference / n),
            "perplexity_served": math.exp(self.nll_served / n),
        }


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
        self.totals = ProbeTotals()
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
        ref = window_log_probs(self.reference, inputs)
        served = window_log_probs(self.served, inputs, self.kv_cache_dtype)
        t = self.totals
        t.positions += len(inputs)
        t.kl_sum += float((ref.exp() * (ref - served)).sum())
        t.agree += int((ref.argmax(-1) == served.argmax(-1)).sum())
        t.nll_reference -= float(ref.gather(1, targets[:, None]).sum())
        t.nll_served -= float(served.gather(1, targets[:, None]).sum())
        self.on_update(t.snapshot())
