"""quant-eval's scorer and report: teacher-forced log-probs equal the engine's own, windows cover
every position once, and the command reports KL / top-1 / perplexity for both paths."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.cli import main
from kvflow.quality.teacher_forcing import window_log_probs, windows


def test_windows_predict_every_token_once() -> None:
    ids = list(range(10))
    chunks = windows(ids, 4)
    assert chunks == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9]]
    predicted = [t for c in chunks for t in c[1:]]
    assert predicted == ids[1:]


def test_scorer_matches_the_engines_logprobs(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    llm = LLM(str(tiny_checkpoint_factory("llama")), dtype="float32", max_model_len=128)
    prompt = llm.get_tokenizer().encode("def main():\n    return 1")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0].outputs[0]
    assert out.logprobs is not None
    scored = window_log_probs(llm.llm_engine.model_runner.model, prompt)[-1]
    for token, lp in out.logprobs[0].items():
        assert float(scored[token]) == pytest.approx(lp.logprob, abs=1e-4)
    assert int(scored.argmax()) == out.token_ids[0]
    assert torch.isclose(scored.exp().sum(), torch.tensor(1.0), atol=1e-4)


def test_quant_eval_command(
    tiny_checkpoint_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tiny_checkpoint_factory("qwen2", dtype=torch.bfloat16))
    args = ["quant-eval", path, "--quantization", "int8", "--window", "63", "--max-tokens", "200", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["positions"] == 199
    assert 0.0 <= report["mean_kl"] < 0.05 and 0.8 <= report["top1_agreement"] <= 1.0
    reference, quantized = report["paths"]
    assert reference["perplexity"] > 1 and quantized["perplexity"] > 1
    assert quantized["weight_bytes"] < reference["weight_bytes"]


def test_quant_eval_reads_kv_back_from_the_quantized_pool(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    from kvflow.quality.quant_eval import compare

    path = str(tiny_checkpoint_factory("qwen2", dtype=torch.bfloat16))
    reference = LLM(path, max_model_len=64)
    ids = reference.get_tokenizer().encode("def main():\n    return [x * 2 for x in range(10)]\n" * 4)
    kl = {}
    for kv in ("int8", "int4"):
        candidate = LLM(path, max_model_len=64, kv_cache_dtype=kv)
        kl[kv] = compare(reference, candidate, ids, 63, kv)["mean_kl"]
    assert 0.0 < kl["int8"] < kl["int4"]  # coarser KV, larger divergence (and never exactly zero)


def test_decode_path_scores_each_position_as_a_decode_row(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    """In float32 both paths compute the same function (decode rows attend the keys earlier steps
    wrote): a wrong slot, position or mask in the decode rows would show as errors of order 1."""
    llm = LLM(str(tiny_checkpoint_factory("mistral")), dtype="float32", max_model_len=128)  # sliding window
    ids = llm.get_tokenizer().encode("def main():\n    return [x * 2 for x in range(10)]\n" * 2)
    model = llm.llm_engine.model_runner.model
    prefill = window_log_probs(model, ids)
    decode = window_log_probs(model, ids, path="decode")
    assert decode.shape == prefill.shape == (len(ids), model.config.vocab_size)
    assert float((decode - prefill).abs().max()) < 1e-4


def test_quant_eval_decode_path_command(
    tiny_checkpoint_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """int4 decode rows go through the GEMV that quantizes activations to int8: it may cost a little
    over the prefill path's bf16 activations, not more (this random model is far more sensitive to
    int4 weights than a trained one: benchmarks/NOTES.md has the bundled model's figures)."""
    path = str(tiny_checkpoint_factory("qwen2", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256))
    args = ["quant-eval", path, "--quantization", "int4", "--quantization-group-size", "32"]
    reports = {}
    for scoring in ("prefill", "decode"):
        assert main([*args, "--window", "40", "--max-tokens", "81", "--path", scoring, "--json"]) == 0
        reports[scoring] = json.loads(capsys.readouterr().out)
        assert reports[scoring]["path"] == scoring and reports[scoring]["positions"] == 80
    assert reports["decode"]["mean_kl"] <= 1.25 * reports["prefill"]["mean_kl"] + 0.01
    assert reports["decode"]["top1_agreement"] >= reports["prefill"]["top1_agreement"] - 0.1


def test_quant_eval_compares_gguf_files_of_the_model(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--candidate: other files of the same model (here its Q8_0 and Q4_K_M GGUF files) scored against
    the bf16 checkpoint, one report each; the coarser file is the further one."""
    pytest.importorskip("gguf")
    from fixtures.gguf_files import q4_k_m, uniform, write_gguf

    checkpoint = tiny_checkpoint_factory(
        "qwen2", dtype=torch.bfloat16, hidden_size=256, intermediate_size=512
    )
    files = {name: tmp_path / f"model-{name}.gguf" for name in ("Q8_0", "Q4_K_M")}
    write_gguf(checkpoint, files["Q8_0"], uniform("Q8_0"))
    write_gguf(checkpoint, files["Q4_K_M"], q4_k_m)
    args = ["quant-eval", str(checkpoint), "--window", "63", "--max-tokens", "200", "--json"]
    assert main([*args, "--candidate", str(files["Q8_0"]), "--candidate", str(files["Q4_K_M"])]) == 0
    q8, q4 = json.loads(capsys.readouterr().out)
    assert q8["positions"] == q4["positions"] == 199
    assert [q8["paths"][1]["label"], q4["paths"][1]["label"]] == ["model-Q8_0.gguf", "model-Q4_K_M.gguf"]
    assert 0.0 <= q8["mean_kl"] < q4["mean_kl"] and q8["top1_agreement"] >= 0.8
    assert q4["paths"][1]["weight_bytes"] < q8["paths"][1]["weight_bytes"] < q8["paths"][0]["weight_bytes"]
