"""Qwen3-Next's Gated DeltaNet ops against transformers' reference functions: the chunked prefill and the
recurrent decode step of the gated delta rule (grouped value heads, states carried in and out, prefix
checkpoints), the causal conv with its state, the gating and the gated norm; and a whole HF
Qwen3NextGatedDeltaNet layer rebuilt from kvflow's pieces."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

from kvflow.attention.causal_conv import causal_conv1d_decode, causal_conv1d_prefill, conv_state_after
from kvflow.attention.gated_delta_net import (
    chunk_gated_delta_rule,
    gated_rms_norm,
    gdn_gating,
    recurrent_gated_delta_rule_step,
)

HK, HV, DK, DV = 2, 4, 32, 16  # grouped value heads, m = 2 (Qwen3-Next-80B: 16, 32, 128, 128)
CONV_DIM, KERNEL = 24, 4


class _Inputs(NamedTuple):
    """q, k [*, T, Hk, dk], v [*, T, Hv, dv], g, beta [*, T, Hv] (* = a batch, for the step form)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def select(self, index: int | slice | tuple[slice, int]) -> _Inputs:
        return _Inputs(*(t[index] for t in self))

    def to(self, dtype: torch.dtype) -> _Inputs:
        return _Inputs(*(t.to(dtype) for t in self))


def _inputs(num_tokens: int, seed: int = 0, batch: int | None = None) -> _Inputs:
    """Random inputs in Qwen3-Next's ranges: g < 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    lead = (num_tokens,) if batch is None else (batch, num_tokens)
    return _Inputs(
        torch.randn(*lead, HK, DK, generator=gen),
        torch.randn(*lead, HK, DK, generator=gen),
        torch.randn(*lead, HV, DV, generator=gen),
        -torch.rand(*lead, HV, generator=gen) * 0.5,
        torch.rand(*lead, HV, generator=gen),
    )


def _state(seed: int, batch: int | None = None) -> torch.Tensor:
    lead = () if batch is None else (batch,)
    return torch.randn(*lead, HV, DK, DV, generator=torch.Generator().manual_seed(seed)) * 0.1


def _hf_chunk(x: _Inputs, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's chunked rule on one request (batch 1): -> (out [T, Hv, dv], final state [Hv, dk, dv])."""
    out, final = hf.torch_chunk_gated_delta_rule(
        *(t.unsqueeze(0) for t in x),
        initial_state=None if state is None else state.unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert final is not None
    return out[0], final[0]


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """Float32 agreement to `rel` of the reference's magnitude (sums of up to 64 x dk products)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


@pytest.mark.parametrize("num_tokens", [1, 37, 64, 100, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_transformers(num_tokens: int, with_state: bool) -> None:
    x = _inputs(num_tokens)
    state = _state(1) if with_state else None
    result = chunk_gated_delta_rule(*x, initial_state=state)
    ref_out, ref_state = _hf_chunk(x, state)
    _close(result.out, ref_out)
    _close(result.final_state, ref_state)
    assert result.checkpoint_states == []


def test_recurrent_step_matches_transformers_and_chunked() -> None:
    """B = 3 requests with their own states, stepped over T = 150 tokens (three 64-token chunks)."""
    batch, num_tokens = 3, 150
    x = _inputs(num_tokens, seed=2, batch=batch)
    state0 = _state(3, batch=batch)
    state, outs = state0, []
    for t in range(num_tokens):
        out, state = recurrent_gated_delta_rule_step(*x.select((slice(None), t)), state=state)
        outs.append(out)
    stepped = torch.stack(outs, dim=1)  # [B, T, Hv, dv]
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
        *x,
        initial_state=state0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert ref_state is not None
    _close(stepped, ref_out)
    _close(state, ref_state)
    for b in range(batch):
        chunked = chunk_gated_delta_rule(*x.select(b), initial_state=state0[b])
        _close(stepped[b], chunked.out)
        _close(state[b], chunked.final_state)


def test_recurrent_step_in_place_equals_out_of_place() -> None:
    x = _inputs(1, seed=4, batch=2).select((slice(None), 0))
    state = _state(5, batch=2)
    out, new_state = recurrent_gated_delta_rule_step(*x, state=state)
    in_place = state.clone()
    out2, same = recurrent_gated_delta_rule_step(*x, state=in_place, out_state=in_place)
    assert same.data_ptr() == in_place.data_ptr()
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(same, new_state, rtol=0, atol=0)


def test_chunks_carrying_state_equal_one_pass_and_checkpoints_equal_prefixes() -> None:
    sizes = [37, 100, 1, 90]
    total = sum(sizes)
    x = _inputs(total, seed=6)
    state0 = _state(7)
    whole = chunk_gated_delta_rule(*x, initial_state=state0)
    state, start, outs = state0, 0, []
    for size in sizes:
        part = chunk_gated_delta_rule(*x.select(slice(start, start + size)), initial_state=state)
        outs.append(part.out)
        state, start = part.final_state, start + size
    _close(torch.cat(outs), whole.out)
    _close(state, whole.final_state)
    # Checkpoints on and off the 64-token grid, unsorted, repeated, and at the chunk's end.
    checkpoints = [100, 1, 64, 128, 37, 100, total, 200]
    marked = chunk_gated_delta_rule(*x, initial_state=state0, checkpoints=checkpoints)
    _close(marked.out, whole.out)
    _close(marked.final_state, whole.final_state)
    for j, got in zip(checkpoints, marked.checkpoint_states, strict=True):
        _close(got, chunk_gated_delta_rule(*x.select(slice(0, j)), initial_state=state0).final_state)


def test_checkpoint_out_of_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="checkpoints"):
        chunk_gated_delta_rule(*_inputs(10), checkpoints=[11])


def test_bf16_inputs_give_bf16_outputs_and_float32_states() -> None:
    x = _inputs(80, seed=8).to(torch.bfloat16)
    state0 = _state(9)
    result = chunk_gated_delta_rule(*x, initial_state=state0, checkpoints=[50])
    assert result.out.dtype == torch.bfloat16
    assert all(s.dtype == torch.float32 for s in (result.final_state, *result.checkpoint_states))
    # The math runs in float32 on the bf16 values: the float32 pass on them, the output rounded once.
    exact = chunk_gated_delta_rule(*x.to(torch.float32), initial_state=state0, checkpoints=[50])
    torch.testing.assert_close(result.final_state, exact.final_state, rtol=0, atol=0)
    torch.testing.assert_close(result.out, exact.out.to(torch.bfloat16), rtol=0, atol=0)
    # HF's grid has no cut at 50: float32 sums in another order, so up to one bf16 ulp (2^-7 relative).
    ref_out, ref_state = _hf_chunk(x, state0)
    assert ref_out.dtype == torch.bfloat16
    torch.testing.assert_close(result.out, ref_out, rtol=2**-7, atol=2**-7)
    _close(result.final_state, ref_state)
    step_x = x.select(slice(0, 1))  # the first token as a batch of one
    out, state = recurrent_gated_delta_rule_step(*step_x, state=state0.unsqueeze(0))
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# The causal conv.


def _conv_problem(num_tokens: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(num_tokens, CONV_DIM, generator=gen).to(dtype)
    return x, (torch.randn(CONV_DIM, KERNEL, generator=gen) * 0.5).to(dtype)


def _hf_conv_chunks(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """HF's cache path over consecutive chunks (cache.update_conv_state, then causal_conv1d_fn over
    [state | x]): -> (out [T, C], its K-column state [C, K]). The first chunk is a fresh prefill."""
    state, start, outs = None, 0, []
    for size in sizes:
        chunk = x[start : start + size].t().unsqueeze(0)  # [1, C, T]
        full = chunk if state is None else torch.cat((state, chunk), dim=-1)
        if full.shape[-1] < KERNEL:
            full = F.pad(full, (KERNEL - full.shape[-1], 0))
        outs.append(hf.causal_conv1d_fn(full, weight, activation="silu")[0, :, -size:].t())
        state, start = full[..., -KERNEL:], start + size
    assert state is not None
    return torch.cat(outs), state[0]


@pytest.mark.parametrize("sizes", [[50], [2], [37, 2, 100, 1]])
def test_conv_prefill_matches_transformers_across_chunks(sizes: list[int]) -> None:
    x, weight = _conv_problem(sum(sizes))
    ref_out, ref_state = _hf_conv_chunks(x, weight, sizes)
    state, start, outs = torch.zeros(CONV_DIM, KERNEL - 1), 0, []
    for size in sizes:
        out, state = causal_conv1d_prefill(x[start : start + size], weight, state)
        outs.append(out)
        start += size
    torch.testing.assert_close(torch.cat(outs), ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state, ref_state[:, 1:], rtol=0, atol=0)  # HF's column 0 is never read
    fresh, _ = causal_conv1d_prefill(x[: sizes[0]], weight)  # None: a fresh request
    torch.testing.assert_close(fresh, outs[0], rtol=0, atol=0)


def test_conv_state_after_equals_prefill_over_the_prefix() -> None:
    x, weight = _conv_problem(9)
    state0 = torch.randn(CONV_DIM, KERNEL - 1, generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(conv_state_after(x, state0, 0), state0, rtol=0, atol=0)
    for j in range(1, x.shape[0] + 1):  # j < K-1 keeps part of the incoming state
        _, expected = causal_conv1d_prefill(x[:j], weight, state0)
        torch.testing.assert_close(conv_state_after(x, state0, j), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_decode_matches_transformers(dtype: torch.dtype) -> None:
    batch, steps = 3, 5
    gen = torch.Generator().manual_seed(12)
    _, weight = _conv_problem(1, dtype)
    state = torch.randn(batch, CONV_DIM, KERNEL - 1, generator=gen).to(dtype)
    hf_state = torch.cat((torch.zeros(batch, CONV_DIM, 1, dtype=dtype), state), dim=-1)  # K columns
    for _ in range(steps):
        x = torch.randn(batch, CONV_DIM, generator=gen).to(dtype)
        out, state = causal_conv1d_decode(x, weight, state)
        # HF's update writes hf_state in place.
        ref = hf.causal_conv1d_update(x.unsqueeze(-1), hf_state, weight, activation="silu")
        assert out.dtype == dtype and state.dtype == dtype
        # HF convolves K+1 inputs for its one output, kvflow K: another summation order, so float32
        # may differ in the last bit (and bf16, rounded from it, by one ulp at a rounding boundary).
        tol = 1e-6 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(out, ref[..., 0], rtol=tol, atol=tol)
        torch.testing.assert_close(state, hf_state[..., 1:], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# Gating, gated norm, and a whole layer.


def test_gated_rms_norm_matches_transformers_bf16() -> None:
    gen = torch.Generator().manual_seed(13)
    norm = hf.Qwen3NextRMSNormGated(DV, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(DV, generator=gen))
    x, gate = (torch.randn(7, DV, generator=gen).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        expected = norm(x, gate)
    got = gated_rms_norm(x, gate, norm.weight, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _tiny_layer() -> hf.Qwen3NextGatedDeltaNet:
    config = Qwen3NextConfig(
        hidden_size=48,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=KERNEL,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(14)
    layer = hf.Qwen3NextGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        layer.dt_bias.normal_()
        layer.norm.weight.normal_()
    return layer.eval()


def test_layer_rebuilt_from_kvflow_ops_matches_transformers() -> None:
    """The model file's composition: projections, conv prefill, gating, delta rule, gated norm, out_proj;
    prefill 70 tokens in two chunks, then 3 decode steps, equal to HF's layer over the 73 tokens."""
    layer = _tiny_layer()
    hidden = torch.randn(1, 73, 48, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        expected = layer(hidden)[0]
        qkvz, ba = layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden)
        q, k, v, z, b, a = (t[0] for t in layer.fix_query_key_value_ordering(qkvz, ba))
        mixed = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1)  # [T, conv_dim]
        g, beta = gdn_gating(a, b, layer.A_log, layer.dt_bias)
        weight = layer.conv1d.weight.squeeze(1)
        conv_state = torch.zeros(mixed.shape[1], KERNEL - 1)
        state: torch.Tensor | None = None
        outs = []
        for start, end in [(0, 30), (30, 70), (70, 71), (71, 72), (72, 73)]:
            if end - start > 1 or state is None:
                conv_out, conv_state = causal_conv1d_prefill(mixed[start:end], weight, conv_state)
            else:
                conv_out, batched = causal_conv1d_decode(mixed[start:end], weight, conv_state.unsqueeze(0))
                conv_state = batched[0]
            cq, ck, cv = conv_out.split([HK * DK, HK * DK, HV * DV], dim=-1)
            heads = (cq.unflatten(-1, (HK, DK)), ck.unflatten(-1, (HK, DK)), cv.unflatten(-1, (HV, DV)))
            if end - start > 1 or state is None:
                result = chunk_gated_delta_rule(*heads, g[start:end], beta[start:end], initial_state=state)
                out, state = result.out, result.final_state
            else:
                out, batched = recurrent_gated_delta_rule_step(
                    *heads, g[start:end], beta[start:end], state.unsqueeze(0)
                )
                state = batched[0]
            outs.append(gated_rms_norm(out, z[start:end], layer.norm.weight, layer.norm.variance_epsilon))
        got = layer.out_proj(torch.cat(outs).flatten(1))
    _close(got, expected, rel=1e-5)
