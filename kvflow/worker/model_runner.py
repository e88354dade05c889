"""Runs one engine step on the model: flat batch -> forward -> logits at sampling rows -> tokens.

A decode-only step on the native decoder skips the flat batch's tensors (input_batch.DecodeRows:
plain lists, since a step's Python runs with the caches cold), and a step whose rows are all plain
greedy skips the logits: the LM head's greedy GEMV returns each row's argmax (drafts are accepted
against it).

Owns the per-request sampling state the scheduler does not need: the torch.Generator of each
seeded request (created on its first sampled token, dropped when the scheduler reports it
finished), so that a seeded request's tokens depend only on its seed and its logits.

A failure that belongs to one request stays with it: the forward pass depends only on token ids
and positions (validated at admission), but sampling reads each request's own parameters,
generator and drafts. If the batched sampler raises, each row is sampled again alone (seeded
generators rewound first), and the rows that still fail are reported in `ModelRunnerOutput.failed`;
the engine ends those requests and the rest of the batch advances as if nothing had happened.
"""

from __future__ import annotations

import torch

from kvflow.attention.kv_store import KVStore
from kvflow.config import ConfigError
from kvflow.kv_offload.block_bytes import OffloadIO
from kvflow.models.llama import LlamaFamilyForCausalLM
from kvflow.models.native_decoder import build_native_decoder
from kvflow.outputs import ModelRunnerOutput, TokenLogprobs
from kvflow.sample.rejection_sampler import greedy_accept, sample_one
from kvflow.sample.sampler import Sampler, SamplingBatch, filtered_probs
from kvflow.sample.token_bitmask import apply_token_bitmask
from kvflow.scheduler_output import GrammarBitmask, ScheduledRequest, SchedulerOutput
from kvflow.worker.input_batch import build_decode_rows, build_input_batch
from kvflow.worker.prompt_logprobs import compute_prompt_logprobs


def enable_batch_invariance(model: LlamaFamilyForCausalLM, kv_store: KVStore) -> None:
    """Batch-invariant mode's model half: every linear through its row-invariant GEMV (the attention
    half is in build_input_batch: every query a row of its own). Only the native kernels promise
    row invariance, so a model with a part on a torch path is refused."""
    model.set_batch_invariant()
    if build_native_decoder(model, kv_store) is None:
        family = getattr(model, "native_decode_unsupported", None)  # MoE / latent attention
        raise ConfigError(
            f"batch_invariant is not supported for {model.config.architecture}: {family}"
            if family
            else "batch_invariant needs every layer on kvflow's native kernels: a bfloat16 model (dtype "
            "bfloat16), a CPU with AVX512-BF16 or AVX2, int4 group sizes 32/64/128, and no act-order parts"
        )


class ModelRunner:
    def __init__(
        self,
        model: LlamaFamilyForCausalLM,
        kv_store: KVStore,
        eos_token_ids: frozenset[int],
        seed: int,
        enforce_eager: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.kv_store = kv_store
        self.batch_invariant = batch_invariant
        if batch_invariant:
            enable_batch_invariance(model, kv_store)
        # Decode-only steps in one native call unless the Python path is asked for (or the only one).
        self.native_decode = not enforce_eager and model.bind_native_decoder(kv_store)
        self.block_size = kv_store.block_size
        self.sliding_window = model.config.sliding_window
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(torch.Generator().manual_seed(seed))
        self._generators: dict[str, torch.Generator] = {}
        # This step's structured-output masks (SchedulerOutput.grammar_bitmask), as a tensor when read.
        self._grammar_bitmask: GrammarBitmask | None = None
        self._grammar_bitmask_tensor: torch.Tensor | None = None
        # The KV offload tier's block copies (kvflow/kv_offload/block_bytes.py); None without a tier.
        self.kv_offload: OffloadIO | None = None

    def _generator(self, req: ScheduledRequest) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        if req.request_id not in self._generators:
            self._generators[req.request_id] = torch.Generator().manual_seed(seed)
        return self._generators[req.request_id]

    def _banned_token_ids(self, req: ScheduledRequest) -> list[int]:
        """min_tokens: EOS (unless ignored) and stop token ids may not end the output early. Not for
        structured output: its grammar alone decides where the output may end (a ban could leave a
        finished grammar, which allows only EOS, with no token at all)."""
        params = req.sampling_params
        if len(req.output_token_ids) >= params.min_tokens or params.structured_outputs is not None:
            return []
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        return eos + list(params.stop_token_ids)

    def _sampling_batch(self, requests: list[ScheduledRequest]) -> SamplingBatch:
        return SamplingBatch(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[self._generator(r) for r in requests],
            banned_token_ids=[self._banned_token_ids(r) for r in requests],
            token_bitmasks=self._token_bitmasks(requests),
        )

    def _token_bitmasks(self, requests: list[ScheduledRequest]) -> list[torch.Tensor | None] | None:
        """Each constrained row's [W] int32 allowed-token mask; waits for the mask thread on first use."""
        grammar = self._grammar_bitmask
        if grammar is None or not any(r.request_id in grammar.rows for r in requests):
            return None
        if self._grammar_bitmask_tensor is None:
            self._grammar_bitmask_tensor = torch.from_numpy(grammar.array())  # [N, W]
        table = self._grammar_bitmask_tensor
        return [table[grammar.rows[r.request_id]] if r.request_id in grammar.rows else None for r in requests]

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
        if self.kv_offload is not None:
            self.kv_offload.apply(scheduler_output.kv_saves, scheduler_output.kv_restores)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        self._grammar_bitmask, self._grammar_bitmask_tensor = scheduler_output.grammar_bitmask, None
        requests, sampling_requests, hidden, sampled = self._forward(scheduler_output)
        prompt_logprobs = compute_prompt_logprobs(self.model, requests, hidden)  # {} unless a request asks
        if not sampling_requests:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        if self._greedy_from_argmax(sampling_requests):
            tokens = self.model.greedy_tokens(sampled)  # [N], or None without a native LM head
            if tokens is not None:
                return self._greedy_output(sampling_requests, tokens.tolist(), prompt_logprobs)
        logits = self.model.compute_logits(sampled)  # [N, V]
        # Rows: one per plain request, 1 + k per request verifying k drafts (in batch order).
        plain_rows, plain_requests, spec = [], [], []
        row = 0
        for req in sampling_requests:
            if req.num_spec_tokens:
                spec.append((req, row))
            else:
                plain_rows.append(row)
                plain_requests.append(req)
            row += 1 + req.num_spec_tokens
        output = ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        if plain_requests:
            if len(plain_rows) == logits.shape[0]:  # no verification rows: every row, in order
                self._sample_plain(logits, plain_requests, output)
            else:
                rows = torch.tensor(plain_rows, dtype=torch.int64)
                self._sample_plain(logits.index_select(0, rows), plain_requests, output)
        for req, first in spec:
            try:
                output.sampled_token_ids[req.request_id] = self._verify(
                    req, logits[first : first + 1 + req.num_spec_tokens]
                )
            except Exception as exc:  # this request's drafts or parameters: it alone fails
                output.failed[req.request_id] = _describe(exc)
        return output

    def _forward(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[list[ScheduledRequest], list[ScheduledRequest], torch.Tensor, torch.Tensor]:
        return forward_step(
            self.model, self.kv_store, scheduler_output, self.native_decode, self.batch_invariant
        )

    def _greedy_from_argmax(self, requests: list[ScheduledRequest]) -> bool:
        """Every row's outcome follows from the argmax of its raw logits: greedy, with no logprobs,
        penalties, logit bias, banned tokens or grammar mask (plain rows sample that argmax, verified
        drafts are accepted while they equal it)."""
        grammar = self._grammar_bitmask
        for req in requests:
            params = req.sampling_params
            if (
                not params.is_greedy
                or params.logprobs is not None
                or params.has_penalties
                or params.logit_bias
                or self._banned_token_ids(req)
                or (grammar is not None and req.request_id in grammar.rows)
            ):
                return False
        return True

    @staticmethod
    def _greedy_output(
        requests: list[ScheduledRequest],
        best: list[int],
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]],
    ) -> ModelRunnerOutput:
        """The step's tokens from each sampling row's argmax `best` (1 + k rows per request)."""
        output = ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        row = 0
        for req in requests:
            k = req.num_spec_tokens
            drafts = req.token_ids[len(req.token_ids) - k :]
            output.sampled_token_ids[req.request_id] = greedy_accept(drafts, best[row : row + k + 1])
            row += k + 1
        return output

    def _sample_plain(
        self, logits: torch.Tensor, requests: list[ScheduledRequest], output: ModelRunnerOutput
    ) -> None:
        """One batched sampler call over logits [R, V]; if it raises, every row alone (module docstring)."""
        rewind = self._generator_states(requests)
        try:
            self._record(requests, self._sample_rows(logits, requests), output)
            return
        except Exception:
            self._rewind_generators(requests, rewind)
        for i, req in enumerate(requests):
            try:
                self._record([req], self._sample_rows(logits[i : i + 1], [req]), output)
            except Exception as exc:
                output.failed[req.request_id] = _describe(exc)

    def _sample_rows(
        self, logits: torch.Tensor, requests: list[ScheduledRequest]
    ) -> list[tuple[int, TokenLogprobs | None]]:
        sampled = self.sampler(logits, self._sampling_batch(requests))
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if sampled.logprobs is not None:
            logprobs = list(sampled.logprobs)
        return list(zip(sampled.token_ids, logprobs, strict=True))

    @staticmethod
    def _record(
        requests: list[ScheduledRequest],
        rows: list[tuple[int, TokenLogprobs | None]],
        output: ModelRunnerOutput,
    ) -> None:
        for req, (token_id, logprobs) in zip(requests, rows, strict=True):
            output.sampled_token_ids[req.request_id] = [token_id]
            if logprobs is not None and req.sampling_params.logprobs is not None:
                output.logprobs[req.request_id] = [logprobs]

    def _generator_states(self, requests: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
        """The state of every seeded row's existing generator (a 5 KB copy each), so that a failed
        batched attempt can be replayed row by row from exactly where it started."""
        return {
            r.request_id: g.get_state()
            for r in requests
            if (g := self._generators.get(r.request_id)) is not None
        }

    def _rewind_generators(self, requests: list[ScheduledRequest], states: dict[str, torch.Tensor]) -> None:
        for req in requests:
            if req.request_id in states:
                self._generators[req.request_id].set_state(states[req.request_id])
            else:  # created during the failed attempt, maybe drawn from: start it afresh
                self._generators.pop(req.request_id, None)

    def _verify(self, req: ScheduledRequest, logits: torch.Tensor) -> list[int]:
        """Accept a prefix of the drafts by the exact rejection rule (spec_decode/rejection_sampler.py).
        logits [k + 1, V]: row i scores draft i, the last row gives the token after all of them.
        The proposer only drafts for requests without penalties, logprobs or banned tokens, so the
        target distribution is exactly what the plain sampler would draw from; with structured output,
        once each row is masked by the grammar's mask at its position."""
        drafts = req.token_ids[-req.num_spec_tokens :]
        params = req.sampling_params
        logits = logits.float()
        masks = self._draft_bitmasks(req)  # [k + 1, W] or None
        if masks is not None:
            logits = logits.clone()  # the step's shared logits stay untouched
            apply_token_bitmask(logits, torch.arange(logits.shape[0]), masks)
        if params.is_greedy:
            emitted, _ = sample_one(logits, drafts, None, greedy=True)
            return emitted
        probs = filtered_probs(logits, [params] * logits.shape[0])
        generator = self._generator(req) or self.sampler.default_generator
        emitted, _ = sample_one(probs, drafts, req.spec_draft_probs, greedy=False, generator=generator)
        return emitted

    def _draft_bitmasks(self, req: ScheduledRequest) -> torch.Tensor | None:
        """A constrained request's k + 1 grammar masks (after each draft prefix), or None."""
        grammar = self._grammar_bitmask
        if grammar is None or req.request_id not in grammar.rows:
            return None
        if self._grammar_bitmask_tensor is None:
            self._grammar_bitmask_tensor = torch.from_numpy(grammar.array())  # [N, W]
        start = grammar.rows[req.request_id]
        return self._grammar_bitmask_tensor[start : start + 1 + req.num_spec_tokens]


def forward_step(
    model: LlamaFamilyForCausalLM,
    kv_store: KVStore,
    scheduler_output: SchedulerOutput,
    native_decode: bool,
    batch_invariant: bool = False,
) -> tuple[list[ScheduledRequest], list[ScheduledRequest], torch.Tensor, torch.Tensor]:
    """One step's forward -> (its requests in flat-batch order, those that sample, hidden [T, H], the
    hidden rows to sample [N, H]). With the native decoder bound to `kv_store`, a decode-only step
    goes to it as plain lists (DecodeRows); any other through build_input_batch's tensors and the
    model's forward. Every tensor-parallel rank runs this, so their collectives come in one order."""
    rows = build_decode_rows(scheduler_output, batch_invariant) if native_decode else None
    if rows is not None:
        hidden = model.forward_decode_rows(rows.token_ids, rows.positions, rows.block_tables)
        indices = rows.logits_indices  # increasing: all rows exactly when there are as many
        sampled = (
            hidden
            if len(indices) == hidden.shape[0]
            else hidden.index_select(0, torch.tensor(indices, dtype=torch.int64))
        )
        return rows.requests, rows.sampling_requests, hidden, sampled
    batch = build_input_batch(
        scheduler_output,
        kv_store.block_size,
        model.config.sliding_window,
        all_query_rows=batch_invariant,
        kv_cache_config=kv_store.kv_cache_config,
    )
    hidden = model(batch.input_ids, batch.attn_metadata, kv_store)  # [T, hidden]
    return batch.requests, batch.sampling_requests, hidden, hidden.index_select(0, batch.logits_indices)


def _describe(exc: Exception) -> str:
    return f"sampling failed: {type(exc).__name__}: {exc}"
