"""GGUF files as users bring them, and as they break: `LLM("model.gguf")` and `kvflow generate
model.gguf`; a truncated download, an unknown ggml type, an architecture or tokenizer kvflow does
not run, a missing tensor, a file that is not GGUF. Each gets a ModelLoadError naming the file (and
the tensor where one is at fault); nothing crashes. The file's tokenizer (kvflow/gguf/
gguf_tokenizer.py) encodes, decodes and templates as the checkpoint's tokenizer.json does."""

from __future__ import annotations

import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures.checkpoints import SAMPLE_TEXTS, training_corpus
from fixtures.gguf_files import uniform, write_gguf

from kvflow import LLM, SamplingParams
from kvflow.errors import ModelLoadError
from kvflow.gguf.gguf_file import open_gguf
from kvflow.tokenizer import Tokenizer

pytest.importorskip("gguf")

SHAPE = {"hidden_size": 64, "intermediate_size": 128}


@pytest.fixture
def gguf_file(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> tuple[Path, Path]:
    """(a Q8_0 GGUF file of the tiny qwen2 checkpoint, the checkpoint)."""
    checkpoint = tiny_checkpoint_factory("qwen2", **SHAPE)
    path = tmp_path / "model.gguf"
    write_gguf(checkpoint, path, uniform("Q8_0"))
    return path, checkpoint


def _load_error(path: Path, **engine: object) -> str:
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), dtype="float32", **engine)
    return str(info.value)


def test_a_truncated_file_names_the_tensor(gguf_file: tuple[Path, Path]) -> None:
    path, _ = gguf_file
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    message = _load_error(path)
    assert str(path) in message and "truncated" in message and "tensor '" in message


def test_a_file_cut_inside_its_header(gguf_file: tuple[Path, Path]) -> None:
    path, _ = gguf_file
    path.write_bytes(path.read_bytes()[:2000])
    message = _load_error(path)
    assert str(path) in message and "truncated in its header" in message


def test_an_unknown_ggml_type_names_the_tensor(gguf_file: tuple[Path, Path]) -> None:
    path, _ = gguf_file
    data = bytearray(path.read_bytes())
    name = b"blk.1.ffn_up.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 250)  # the type id after the dims
    path.write_bytes(bytes(data))
    message = _load_error(path)
    assert "blk.1.ffn_up.weight" in message and "ggml type 250" in message


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in _load_error(path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 10)
    assert "is a file but not a GGUF file" in _load_error(other)


def test_a_missing_tensor_is_named(tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_gguf(
        tiny_checkpoint_factory("qwen2", **SHAPE),
        path,
        uniform("Q8_0"),
        skip=lambda n: n == "blk.1.ffn_down.weight",
    )
    message = _load_error(path)
    assert "model.layers.1.mlp.down_proj.weight" in message and "blk.1.ffn_down.weight" in message


def test_an_architecture_kvflow_does_not_run(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _load_error(path)
    assert "GGUF architecture 'bert' is not supported" in message and "qwen2" in message


@pytest.mark.parametrize(("kind", "pre"), [("bert", "default"), ("gpt2", "a-new-pre-tokenizer")])
def test_a_tokenizer_kvflow_cannot_rebuild_asks_for_one(
    kind: str, pre: str, tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Other vocabulary kinds (WordPiece) and unknown pre-tokenizers: a clear error, and --tokenizer
    serves."""
    checkpoint = tiny_checkpoint_factory("qwen2", **SHAPE)
    path = tmp_path / "model.gguf"
    write_gguf(checkpoint, path, uniform("Q8_0"), tokenizer=(kind, pre))
    assert "--tokenizer" in _load_error(path)
    llm = LLM(str(path), dtype="float32", tokenizer=str(checkpoint))
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_the_files_tokenizer_matches_tokenizer_json(gguf_file: tuple[Path, Path]) -> None:
    path, checkpoint = gguf_file
    ours, reference = Tokenizer.from_gguf(path), Tokenizer.from_pretrained(checkpoint)
    for text in [*SAMPLE_TEXTS, *training_corpus(50, seed=3), "<|im_start|>user\nhi<|im_end|>\n"]:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert ours.bos_token_id == reference.bos_token_id and ours.eos_token_ids == reference.eos_token_ids
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages)


def test_metadata_reads_as_the_gguf_package_reads_it(gguf_file: tuple[Path, Path]) -> None:
    """kvflow parses the header itself (gguf.GGUFReader took 6 s on a 150k vocabulary): the same
    metadata and tensors as llama.cpp's Python reader."""
    import gguf
    import numpy as np

    path, _ = gguf_file
    ours, reader = open_gguf(path), gguf.GGUFReader(path)
    assert ours.metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert mine.type_name == t.tensor_type.name
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert np.array_equal(
            np.asarray(mine.data).view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel()
        )


def test_kvflow_generate_runs_a_gguf_file(gguf_file: tuple[Path, Path]) -> None:
    path, _ = gguf_file
    result = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "generate", str(path), "--prompt", "hello", "--chat",
         "--max-tokens", "6", "--ignore-eos", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "GGUF model.gguf" in result.stderr and "TTFT" in result.stderr


def test_bench_counts_tokens_with_the_files_tokenizer(gguf_file: tuple[Path, Path]) -> None:
    """`kvflow bench --tokenizer model.gguf` (against a llama-server of that file), or the GGUF a
    kvflow server names as its root: the file's own tokenizer counts the tokens."""
    from kvflow.bench.arrivals import LoadSpec
    from kvflow.bench.datasets import DatasetSpec
    from kvflow.bench.runner import BenchConfig, ServerInfo, load_tokenizer

    path, checkpoint = gguf_file
    common = {
        "base_url": "http://127.0.0.1:1/v1",
        "dataset": DatasetSpec(name="random", num_requests=1),
        "load": LoadSpec(concurrency=1),
    }
    for config, info in (
        (BenchConfig(**common, tokenizer=str(path)), ServerInfo("m", None, None)),
        (BenchConfig(**common), ServerInfo("m", None, str(path))),
    ):
        tokenizer = load_tokenizer(config, info)
        assert tokenizer is not None
        assert tokenizer.encode("Hello world") == Tokenizer.from_pretrained(checkpoint).encode("Hello world")


def _sentencepiece_gguf(path: Path) -> None:
    """A vocabulary-only GGUF of a SentencePiece BPE model (tokenizer.ggml.model "llama", as Llama 2
    and Mistral 7B files hold theirs): <unk> <s> </s>, the 256 byte pieces, then pieces learned on
    the fixture corpus, each merged piece scored by its merge's rank."""
    import json

    import gguf
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer(unk_token="<unk>", fuse_unk=True)
    trainer.train_from_iterator(
        training_corpus(), vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    model = json.loads(trainer.to_str())["model"]
    merged = {
        "".join(pair if isinstance(pair, list) else pair.split(" ")): rank
        for rank, pair in enumerate(model["merges"])
    }
    pieces = [
        p
        for p, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])
        if p not in ("<unk>", "<s>", "</s>")
    ]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(merged.get(p, -1) + 1) for p in pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_reads_it(tmp_path: Path) -> None:
    """SentencePiece GGUF vocabularies (Llama 2, Mistral 7B, Phi-3) are rebuilt with byte fallback;
    transformers' own GGUF tokenizer converter is the reference. (On llama.cpp's own test vectors,
    ggml-vocab-llama-spm.gguf and -phi-3.gguf from its source, this rebuild gives 46/46 each.) Not on
    text that starts with a space: llama.cpp (and the sentencepiece model) always prepend "▁", while
    transformers' converter skips it there (its Metaspace prepends only to text without one), so
    "  two" is ▁ ▁ ▁t... in llama.cpp and kvflow, ▁ ▁t... in transformers."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "spm.gguf"
    _sentencepiece_gguf(path)
    ours = Tokenizer.from_gguf(path)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [
        *SAMPLE_TEXTS,
        *training_corpus(40, seed=5),
        "two  spaces",
        "tab\there",
        "ʘ unseen ᚠ runes",
    ]:
        ids = reference.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == frozenset({2})
