"""The sampler: logits [B, V] + per-row params -> one token per row (+ logprobs). vLLM v1's order.

Per row, in this order:
  0. raw logprobs (reported):  log_softmax(logits.float())  before anything below (vLLM `raw_logprobs`)
  1. float32 working copy; banned_token_ids -> -inf   (min_tokens: EOS / stop ids);
     logit_bias added (OpenAI's);  structured output's token bitmask: disallowed -> -inf
  2. penalties (penalties.py): repetition, then frequency, then presence
  3. greedy rows (temperature < 1e-5):  token = argmax(l)              (first index on ties)
  4. random rows:
       l <- l / T                                                       temperature
       min_p:  drop v where softmax(l)[v] < min_p * max_u softmax(l)[u]
       top_k:  keep v where l[v] >= k-th largest l                      (k <= 0: off; ties at the k-th kept)
       top_p:  sort ascending, c_j = cumsum of sorted probs; drop j where c_j <= 1 - top_p, never the
               largest: the smallest descending prefix with mass >= top_p (ties cut in sorted order)
       pi = softmax(l);  token = argmax_v pi[v] / q[v],  q[v] = -log(u[v]) ~ Exp(1), u ~ U[0, 1) i.i.d.
The race is a categorical draw: P(argmax_v pi_v / q_v = w) = pi_w, since q_v / pi_v ~ Exp(rate pi_v)
and the smallest of independent exponentials is the one at index w with probability pi_w / sum(pi).

A row with its own generator draws its q [V] from it alone, so a seeded request's tokens depend only
on (seed, its logits, its step count), not on its row index or neighbours; all other rows draw one
[R, V] block from the default generator. Generators must live on the logits' device.

Cost: an all-greedy batch does no softmax, sort or random draw; min_p / top_k / top_p run only when
some random row uses them; top_k without top_p uses `topk`, not a full sort of the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvflow.kernels import argmax_rows
from kvflow.outputs import Logprob, TokenLogprobs
from kvflow.sample.penalties import apply_penalties
from kvflow.sample.token_bitmask import apply_token_bitmask
from kvflow.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# Floor for the Exp(1) draws: q = 0 would make pi / q = 0 / 0 = NaN on a filtered token, and argmax
# treats NaN as the maximum. pi <= 1, so pi / tiny <= 8.5e37 stays finite in float32.
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny


@dataclass
class SamplingBatch:
    """The rows that sample this step (built once per step by the model runner)."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]  # live references, read-only
    output_token_ids: list[list[int]]
    generators: list[torch.Generator | None]  # per row; None -> the sampler's default generator
    banned_token_ids: list[list[int]]  # per row, masked to -inf this step (min_tokens: EOS / stop ids)
    # Structured output: per row, its allowed tokens as a [W] int32 bitmask (token_bitmask.py), or None.
    token_bitmasks: list[torch.Tensor | None] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.params)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: the sampled token plus the top-n (n = params.logprobs) under the RAW distribution;
    # {} for rows that did not ask. None when no row asked.
    logprobs: list[TokenLogprobs] | None


class Sampler:
    def __init__(self, default_generator: torch.Generator) -> None:
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [B, V], any float dtype, never modified. Returns one token per row."""
        _check_batch(logits, batch)
        logprob_rows = [i for i, p in enumerate(batch.params) if p.logprobs is not None]
        # Step 0: raw logprobs before anything touches the logits.  [L, V] float32
        raw_logprobs = _raw_logprobs(logits, logprob_rows) if logprob_rows else None

        work = _penalised_logits(logits, batch)  # [B, V]: as given, or float32 where modified
        sampled = self._sample(work, batch)  # [B] int64

        logprobs: list[TokenLogprobs] | None = None
        if raw_logprobs is not None:
            row_logprobs = gather_logprobs(
                raw_logprobs,
                sampled[torch.tensor(logprob_rows, device=sampled.device)],
                [_num_top(batch.params[i]) for i in logprob_rows],
            )
            logprobs = [{} for _ in range(batch.num_rows)]
            for row, entry in zip(logprob_rows, row_logprobs, strict=True):
                logprobs[row] = entry
        return SamplerOutput(token_ids=sampled.tolist(), logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Steps 3-4: greedy rows by argmax, random rows by filters + exponential race.  -> [B] int64."""
        random_rows = [i for i, p in enumerate(batch.params) if not p.is_greedy]
        if not random_rows:  # fast path: no softmax, sort or random draw at all
            return argmax_tokens(logits)
        all_random = len(random_rows) == batch.num_rows
        row_index = torch.tensor(random_rows, dtype=torch.long, device=logits.device)  # [R]
        # [R, V] float32: greedy rows take the argmax of the logits as given (bf16 widens exactly).
        random_logits = (logits if all_random else logits.index_select(0, row_index)).float()
        probs = filtered_probs(random_logits, [batch.params[i] for i in random_rows])  # [R, V]
        generators = [batch.generators[i] for i in random_rows]
        sampled = exponential_race(probs, generators, self.default_generator)  # [R]
        if all_random:
            return sampled
        tokens = argmax_tokens(logits)  # [B]: greedy rows keep theirs, random rows are overwritten
        tokens[row_index] = sampled
        return tokens


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 or bfloat16 -> [B] int64, torch.argmax's answer; the native kernel where
    it exists (4-10x torch's CPU argmax over 151,936 logits, kvflow/kernels/argmax.cpp)."""
    native = argmax_rows()
    if native is not None and logits.dtype in (torch.float32, torch.bfloat16) and logits.device.type == "cpu":
        return native(logits)
    return logits.argmax(dim=-1)


# ---------------------------------------------------------------------------------------------------
# Steps 0-2: raw logprobs, banned tokens, penalties


def _check_batch(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor [num_rows, vocab], got {tuple(logits.shape)}")
    lengths = {
        "params": len(batch.params),
        "prompt_token_ids": len(batch.prompt_token_ids),
        "output_token_ids": len(batch.output_token_ids),
        "generators": len(batch.generators),
        "banned_token_ids": len(batch.banned_token_ids),
    }
    if any(n != logits.shape[0] for n in lengths.values()):
        raise ValueError(f"sampling batch fields must each have {logits.shape[0]} rows, got {lengths}")


def _raw_logprobs(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """log_softmax(logits.float()) of the given rows.  -> [L, V] float32."""
    if len(rows) != logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
    return torch.log_softmax(logits.float(), dim=-1)


def _penalised_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 1-2: logits with banned tokens at -inf and penalties applied (float32).  -> [B, V].

    Without bans or penalties this is `logits` as given (any float dtype), the caller's own tensor:
    everything downstream treats it as read-only, and _sample converts only the rows that sample (a
    float32 copy of 64 bf16 rows of a 151,936-token vocabulary was ~1 ms per step, for greedy rows
    whose argmax is the same without it).
    """
    has_bans = any(batch.banned_token_ids)
    has_penalties = any(p.has_penalties for p in batch.params)
    has_bias = any(p.logit_bias for p in batch.params)
    masked_rows = [i for i, m in enumerate(batch.token_bitmasks or []) if m is not None]
    if not has_bans and not has_penalties and not has_bias and not masked_rows:
        return logits
    work = logits.to(dtype=torch.float32, copy=True)  # [B, V], ours to write
    if has_bans:
        mask_banned_tokens(work, batch.banned_token_ids)
    if has_bias:
        apply_logit_bias(work, batch.params)
    if masked_rows:
        assert batch.token_bitmasks is not None
        bitmask = torch.stack([batch.token_bitmasks[i] for i in masked_rows])  # type: ignore[misc]
        rows = torch.tensor(masked_rows, dtype=torch.long, device=work.device)
        apply_token_bitmask(work, rows, bitmask.to(work.device))
    if has_penalties:
        apply_penalties(work, batch.params, batch.prompt_token_ids, batch.output_token_ids)
    return work


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: logits[b, v] += logit_bias[v] (ids outside [0, V) ignored, as OpenAI ignores them)."""
    vocab_size = logits.shape[1]
    triples = [
        (row, tok, bias)
        for row, p in enumerate(params)
        for tok, bias in (p.logit_bias or {}).items()
        if 0 <= tok < vocab_size
    ]
    if not triples:
        return
    rows, toks, biases = zip(*triples, strict=True)
    index = torch.tensor([rows, toks], dtype=torch.long, device=logits.device)  # [2, N]
    logits.index_put_((index[0], index[1]), torch.tensor(biases, dtype=logits.dtype), accumulate=True)


def mask_banned_tokens(logits: torch.Tensor, banned_token_ids: Sequence[Sequence[int]]) -> None:
    """logits[b, v] = -inf for every v in banned_token_ids[b] (in place; ids outside [0, V) ignored)."""
    vocab_size = logits.shape[1]
    pairs = [(row, tok) for row, ids in enumerate(banned_token_ids) for tok in ids if 0 <= tok < vocab_size]
    if not pairs:
        return
    rows, toks = zip(*pairs, strict=True)
    index = torch.tensor([rows, toks], dtype=torch.long, device=logits.device)  # [2, N]
    logits[index[0], index[1]] = _NEG_INF


# ---------------------------------------------------------------------------------------------------
# Step 4: temperature, min_p, top_k, top_p on the random rows


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a random row samples from: softmax of the filtered, tempered logits.

    logits [R, V] float32 (read-only), params of those R non-greedy rows.  -> probs [R, V] float32.
    Also the target distribution a speculative-decoding rejection sampler needs.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    logits = apply_temperature(logits, temperature)  # new tensor: safe to write in place below

    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        apply_min_p(logits, min_p)

    use_top_k = any(0 < p.top_k < vocab_size for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    top_k = _top_k_tensor(params, vocab_size, device) if use_top_k else None
    if use_top_p:
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p)
    elif top_k is not None:
        apply_top_k_only(logits, top_k)
    return torch.softmax(logits, dim=-1)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """l / T per row.  logits [R, V], temperature [R] (> 0).  -> a NEW [R, V] tensor."""
    return logits / temperature.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: l[v] = -inf where pi[v] < min_p * max(pi), pi = softmax(l).  min_p [R]; 0 is a no-op."""
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    logits.masked_fill_(probs < threshold, _NEG_INF)


def _top_k_tensor(params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per-row k as int64 [R]; disabled (k <= 0) or oversized (k >= V) rows get k = V (keep all)."""
    ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    return torch.tensor(ks, dtype=torch.long, device=device)


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """In place: l[v] = -inf where l[v] < (k-th largest l), without sorting the vocabulary.

    logits [R, V], top_k [R] in [1, V] (V = disabled). One topk of width max(k over enabled rows).
    """
    vocab_size = logits.shape[1]
    disabled = top_k == vocab_size  # [R]
    k = top_k.masked_fill(disabled, 1)  # disabled rows: any valid k, the threshold is replaced below
    top_values = logits.topk(int(k.max()), dim=-1).values  # [R, max_k], descending
    threshold = top_values.gather(1, (k - 1).unsqueeze(1))  # [R, 1]: the k-th largest
    threshold.masked_fill_(disabled.unsqueeze(1), _NEG_INF)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """top_k then top_p by one ascending sort (vLLM's `apply_top_k_top_p`).  -> a new [R, V] tensor.

    logits [R, V]; top_k [R] in [1, V] or None; top_p [R] in (0, 1] (1 = off).
    Ascending stable sort s_1 <= ... <= s_V (ties: lower token id first):
      top_k: drop j where s_j < s_{V-k+1} (the k-th largest; ties with it are kept)
      top_p: with c_j = sum_{i<=j} softmax(s)_i, drop j where c_j <= 1 - top_p, except j = V.
             Kept = j with sum_{i>j} pi_i < top_p: the shortest descending prefix of mass >= top_p.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=False, stable=True)  # [R, V] each
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))  # [R, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_largest, _NEG_INF)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum_(dim=-1)  # [R, V], ends at ~1
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)  # [R, V]
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return sorted_logits.scatter(dim=-1, index=sorted_index, src=sorted_logits)  # back to vocab order


# ---------------------------------------------------------------------------------------------------
# Step 4 (end): the exponential race


def exponential_race(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> torch.Tensor:
    """token[r] = argmax_v probs[r, v] / q[r, v], q ~ Exp(1).  probs [R, V] -> [R] int64.

    Rows with a generator draw their own q [V] (V uniforms per step, whatever the batch); the others
    share one [R', V] draw from the default generator.
    """
    q = torch.empty(probs.shape, dtype=probs.dtype, device=probs.device)  # [R, V], contiguous
    default_rows = [r for r, g in enumerate(generators) if g is None]
    if len(default_rows) == len(generators):
        q.uniform_(generator=default_generator)
    elif default_rows:
        index = torch.tensor(default_rows, dtype=torch.long, device=probs.device)
        q[index] = torch.empty_like(q[index]).uniform_(generator=default_generator)
    for row, generator in enumerate(generators):
        if generator is not None:
            q[row].uniform_(generator=generator)  # q[row] is a contiguous [V] view
    # Inverse CDF: u ~ U[0, 1) -> q = -log(u) ~ Exp(1). Several times cheaper than `exponential_` on
    # CPU, with the same float32 resolution. u = 0 gives q = inf: that token loses, as q >> 1 would.
    # The floor guards backends whose uniform_ can return 1 (q = 0, and 0 / 0 = NaN wins argmax).
    q.log_().neg_().clamp_(min=_MIN_EXPONENTIAL)
    return torch.div(probs, q, out=q).argmax(dim=-1)  # reuses q's storage for pi / q


# ---------------------------------------------------------------------------------------------------
# Reported logprobs


def _num_top(params: SamplingParams) -> int:
    return params.logprobs or 0


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Per row: {sampled token, then the top-n tokens: Logprob(logprob, rank)}.

    raw_logprobs [L, V], sampled [L] int64, num_top[l] = n >= 0.
    rank(v) = 1 + #{u : lp[u] > lp[v]} (strictly larger, so tied tokens share a rank).
    """
    vocab_size = raw_logprobs.shape[1]
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [L, 1]
    sampled_rank = 1 + (raw_logprobs > sampled_lp).sum(dim=-1)  # [L]
    max_top = min(max(num_top, default=0), vocab_size)
    top_lp, top_ids = raw_logprobs.topk(max_top, dim=-1)  # [L, n_max], descending
    # Within a descending top-n list every strictly larger logprob is also in the list, so the rank
    # is 1 + (position of the first equal value): searchsorted on the ascending -top_lp.
    neg_top = -top_lp
    top_rank = 1 + torch.searchsorted(neg_top, neg_top, side="left")  # [L, n_max]

    rows = zip(
        sampled.tolist(),
        sampled_lp.squeeze(1).tolist(),
        sampled_rank.tolist(),
        top_ids.tolist(),
        top_lp.tolist(),
        top_rank.tolist(),
        num_top,
        strict=True,
    )
    result: list[TokenLogprobs] = []
    for token, lp, rank, ids, lps, ranks, n in rows:
        entry: TokenLogprobs = {token: Logprob(logprob=lp, rank=rank)}
        for tok, tok_lp, tok_rank in zip(ids[:n], lps[:n], ranks[:n], strict=True):
            entry.setdefault(tok, Logprob(logprob=tok_lp, rank=tok_rank))
        result.append(entry)
    return result
