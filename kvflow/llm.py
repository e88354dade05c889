"""The offline facade: `LLM(model, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvflow.engine.engine import LLMEngine, Prompt
from kvflow.errors import RequestFailedError
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams, broadcast_sampling_params


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine.from_kwargs(model=model, **engine_args)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`.

        A prompt is a string or a list of token ids; a single prompt may be passed bare. `priority`:
        one per prompt, lower first (with `scheduling_policy="priority"`), as vLLM's LLM.generate.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompt_list: list[Prompt] = [prompts]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        params = broadcast_sampling_params(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} values for {len(prompt_list)} prompts")
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, p, rank in zip(prompt_list, params, priorities, strict=False):
                ids.append(engine.add_request(None, prompt, p, priority=rank))
            finished: dict[str, RequestOutput] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            engine.abort_request(ids)  # leave the engine clean for the next call
            while engine.has_unfinished_requests():
                engine.step()
            raise
        failed = [finished[i] for i in ids if finished[i].error is not None]
        if failed:
            raise RequestFailedError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [finished[i] for i in ids]
