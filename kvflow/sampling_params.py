"""Per-request sampling parameters (pure Python: no torch import, the scheduler reads them).

Semantics follow vLLM's `SamplingParams`, so that server and client code port unchanged:
- `temperature == 0` means greedy (argmax); the other filters are then irrelevant.
- `top_k <= 0` disables top-k; `top_p == 1` disables top-p; `min_p == 0` disables min-p.
- `repetition_penalty` (multiplicative, CTRL paper) applies to tokens seen in prompt or output;
  `presence_penalty` / `frequency_penalty` (additive, OpenAI) apply to tokens seen in the output only.
- `seed` makes the request's samples a function of (seed, logits) only, whatever else shares the batch.
- `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar (vLLM's
  `StructuredOutputsParams`; compiled and enforced by kvflow/structured/); `logit_bias` adds a bias
  in [-100, 100] to the given token ids' logits (OpenAI's range).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.errors import InvalidRequestError

# Below this temperature sampling is treated as greedy: dividing logits by ~0 would overflow,
# and the distribution is a point mass anyway (vLLM uses the same threshold).
GREEDY_TEMPERATURE_EPS = 1e-5
# OpenAI's documented ranges for the additive penalties.
MAX_ABS_ADDITIVE_PENALTY = 2.0
# The number of top logprobs returned per token is bounded like OpenAI's `top_logprobs` (0..20)
# is, but looser: tests and `quant-eval` ask for whole small vocabularies.
MAX_LOGPROBS = 1024
# The seeds torch.Generator.manual_seed accepts (it reads a uint64, or an int64 it reinterprets);
# anything wider raises inside the batched step, where it would fail every request sharing it.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# OpenAI's documented logit_bias range.
MAX_ABS_LOGIT_BIAS = 100.0
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)  # fmt: skip


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names). `json` is a JSON schema (dict or its text), `regex` a
    regular expression the whole output matches, `choice` the allowed outputs, `grammar` a Lark
    grammar (or GBNF), `json_object` any JSON object. Checked for shape here; whether the schema,
    regex or grammar compiles is checked by kvflow/structured/ (InvalidRequestError naming it)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise InvalidRequestError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: one of json, regex, choice, grammar, json_object."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    # Top-n logprobs of every prompt token after the first (vLLM's `prompt_logprobs`); None: off.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {msg}")

        if self.n != 1:
            raise bad(f"n must be 1 (parallel sampling is not supported yet), got {self.n}")
        for name in _FLOAT_FIELDS:  # inf / NaN would pass the range checks below or poison the logits
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(f"{name} must be a finite number, got {value!r}")
        seed = self.seed
        if seed is not None and (not isinstance(seed, int) or not MIN_SEED <= seed <= MAX_SEED):
            raise bad(f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {self.seed!r}")
        if not self.temperature >= 0.0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= -1 (-1 or 0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_ADDITIVE_PENALTY <= value <= MAX_ABS_ADDITIVE_PENALTY:
                raise bad(f"{name} must be in [-2, 2], got {value}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                raise bad(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not isinstance(bias, (int, float)) or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise bad(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def max_stop_string_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def broadcast_sampling_params(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One params object for all prompts, or one per prompt (checked), or the defaults."""
    if params is None:
        return [SamplingParams() for _ in range(num_prompts)]
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise InvalidRequestError(
            f"got {len(params)} sampling params for {num_prompts} prompts; pass one or one per prompt"
        )
    return params
