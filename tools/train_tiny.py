"""Train small Llama-architecture models on CPU from a corpus every Python installation has.

    python tools/train_tiny.py --out ckpt/target --size target
    python tools/train_tiny.py --out ckpt/draft --size draft --tokenizer ckpt/target

The corpus is the standard library's own source (`*.py` under `sysconfig.get_paths()["stdlib"]`,
site-packages excluded) plus the English prose of `pydoc_data.topics`, split into train and held-out
parts by document (a stable hash of each name, so the split never depends on file order or on the cap).
A byte-level BPE tokenizer with the chat special tokens is trained on the train part (or reused with
--tokenizer: a draft model must share its target's vocabulary), and a Llama model (GQA, RoPE, RMSNorm,
SwiGLU, tied embeddings) is trained on random windows of the tokenized stream.

Distillation (`--teacher TARGET_DIR`, for speculative-decoding drafts): the loss becomes the mean
KL(teacher || student) of the next-token distributions at every position of the same windows, the
teacher being a trained checkpoint on the same tokenizer (run in eval mode, no gradients). A draft
trained on its own data's next tokens learns the corpus; a draft distilled from its target learns what
the target would say, which is what speculation accepts (DistillSpec, Zhou et al. 2023). `--init DIR`
starts from a checkpoint's weights instead of random ones (e.g. the CE-trained draft). The held-out
evaluation then also reports the teacher-forced greedy agreement with the teacher.

Output (DIR): an ordinary Hugging Face checkpoint that `transformers.AutoModelForCausalLM` and
`kvflow.LLM` both load (config.json, model.safetensors in bf16, tokenizer.json, tokenizer_config.json,
generation_config.json), plus train_log.json, the resumable train_state.pt and the cached token streams.

Determinism: everything random derives from --seed (the initial weights, each step's batch, the
held-out windows), so a run is reproducible on the same machine with the same --threads (the thread
count changes the summation order inside matmuls). `--stop-after N` then `--resume` gives bit-identical
weights to an uninterrupted run: the batch of step s depends only on (seed, s) and the learning rate
only on (s, --steps).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from kvflow.assets.hf_progress import hf_progress_bars_disabled
from kvflow.assets.tokenizer_recipe import tokenizer_config as recipe_tokenizer_config
from kvflow.assets.tokenizer_recipe import train_byte_level_bpe

# Local files only: transformers must not ask the Hub anything (set before it is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# ---------------------------------------------------------------------- conventions

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# The BPE trainer gives special tokens the first ids, in this order: <|endoftext|>=0, <|im_start|>=1,
# <|im_end|>=2.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
DEFAULT_VOCAB_SIZE = 8192
MAX_POSITION_EMBEDDINGS = 1024
# ---------------------------------------------------------------------- model shapes

HEAD_DIM = 64
ROPE_THETA = 10000.0
# Llama 2's value; the norm only has to keep 1/rms finite for an all-zero row.
RMS_NORM_EPS = 1e-5
# SwiGLU has three matrices instead of two, so Llama shrinks the 4x MLP to 2/3 of it (8/3 x hidden) to
# keep the parameter count of a 4x GELU MLP; the width is rounded up to a multiple of 64 so that matmul
# tiles stay full.
SWIGLU_RATIO = 8 / 3
MLP_WIDTH_MULTIPLE = 64


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int

    @property
    def intermediate_size(self) -> int:
        width = math.ceil(self.hidden_size * SWIGLU_RATIO)
        return math.ceil(width / MLP_WIDTH_MULTIPLE) * MLP_WIDTH_MULTIPLE


# Shapes picked by parameter count (`count_parameters`, with the default 8192 vocabulary):
#   target: hidden 384 = 6 heads x 64, 2 KV heads (3 query heads per KV head), 10 layers, MLP 1024
#           -> 18.9M parameters, 3.1M of them the (tied) embedding.
#   draft:  hidden 256 = 4 heads x 64, 2 KV heads, 3 layers, MLP 704 -> 4.3M (2.1M embedding); shallow
#           because a draft's decode latency grows with its layer count.
#   tiny:   for tests only: trains 30 steps in a couple of seconds.
SIZES: dict[str, ModelShape] = {
    "target": ModelShape(hidden_size=384, num_hidden_layers=10, num_attention_heads=6, num_key_value_heads=2),
    "draft": ModelShape(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2),
    "tiny": ModelShape(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
}


def count_parameters(shape: ModelShape, vocab_size: int) -> int:
    """Parameters of a tied-embedding Llama of `shape` (checked against the built model's numel)."""
    h, kv_width = shape.hidden_size, shape.num_key_value_heads * HEAD_DIM
    q_width = shape.num_attention_heads * HEAD_DIM
    attention = h * q_width + 2 * h * kv_width + q_width * h  # q, k, v, o projections (no biases)
    mlp = 3 * h * shape.intermediate_size  # gate, up, down
    norms = 2 * h  # input and post-attention RMSNorm weights
    return vocab_size * h + shape.num_hidden_layers * (attention + mlp + norms) + h  # + final norm


# ---------------------------------------------------------------------- training constants

WEIGHT_DECAY = 0.1
ADAM_BETAS = (0.9, 0.95)
GRAD_CLIP_NORM = 1.0
# Cosine decay ends at this fraction of --lr (not 0: the last steps still learn).
MIN_LR_FRACTION = 0.1
# Held-out windows per evaluation: 64 x 257 tokens (at the default --seq-len) is ~16k tokens, enough
# for a perplexity stable to about 1%, at the cost of about one training step.
EVAL_WINDOWS = 64
# The reported final train loss is the mean of the last steps' losses (one step's loss is noisy).
FINAL_LOSS_WINDOW = 20
# Without tqdm, print a progress line every this many steps.
PRINT_EVERY = 10
# Measured once on this project's 2-core AMD EPYC (Zen 4, AVX512-BF16), batch 16 x 256 tokens, 2 threads,
# forward + backward + AdamW alone: the target shape trains at ~1.9k tokens/s under bf16 autocast against
# ~1.1k in fp32 (1.7x), the draft at ~5.6k vs ~3.9k (1.45x); this script's whole step reaches ~1.5-1.7k
# (target) and ~5.6k (draft). Hence bf16 autocast by default (master weights, gradients and optimizer
# state stay fp32); `--autocast fp32` for CPUs without bf16 units, where autocast can be slower.
DEFAULT_AUTOCAST = "bf16"

# ---------------------------------------------------------------------- corpus

# ~5% of documents are held out: a document is held out when its name hashes below this fraction.
HELDOUT_FRACTION = 0.05
STDLIB_PREFIX = "stdlib/"
PYDOC_PREFIX = "pydoc/"
# Directories under the stdlib that are not the standard library (third-party packages) or not source.
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Document:
    name: str  # "stdlib/<path relative to the stdlib>" or "pydoc/<topic>"
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    heldout: list[Document]


def _name_digest(name: str) -> bytes:
    # sha256, not hash(): Python's str hash is salted per process.
    return hashlib.sha256(name.encode("utf-8")).digest()


def is_heldout(name: str) -> bool:
    """Whether the document `name` belongs to the held-out part (deterministic, ~HELDOUT_FRACTION)."""
    unit = int.from_bytes(_name_digest(name)[:8], "big") / 2**64  # uniform in [0, 1)
    return unit < HELDOUT_FRACTION


def _stdlib_sources() -> list[tuple[str, Path]]:
    """(document name, path) of every *.py of the standard library, site-packages pruned."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS]
        for file in files:
            if file.endswith(".py"):
                path = Path(directory, file)
                sources.append((STDLIB_PREFIX + path.relative_to(root).as_posix(), path))
    return sources


def _read_source(path: Path) -> str | None:
    # A few stdlib test files are deliberately not UTF-8 (encoding-declaration tests): skip them.
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def collect_corpus(max_bytes: int | None = None) -> Corpus:
    """The stdlib sources and pydoc topics, split into train / held-out by a hash of each name.

    With `max_bytes`, each part keeps documents (in the order of their name hashes, a stable shuffle) up
    to its share of the cap, skipping those that would overflow it: the held-out part gets
    HELDOUT_FRACTION of the cap, so even a small capped corpus has both parts.
    """
    from pydoc_data.topics import topics

    # (name, size in bytes, source): a stdlib file (read only if selected) or a topic's text.
    candidates: list[tuple[str, int, Path | str]] = [
        (name, path.stat().st_size, path) for name, path in _stdlib_sources()
    ]
    candidates += [(PYDOC_PREFIX + topic, len(text.encode("utf-8")), text) for topic, text in topics.items()]
    candidates.sort(key=lambda candidate: _name_digest(candidate[0]))
    parts: dict[bool, list[Document]] = {False: [], True: []}
    used = {False: 0, True: 0}
    for name, size, source in candidates:
        heldout = is_heldout(name)
        if max_bytes is not None:
            budget = max_bytes * (HELDOUT_FRACTION if heldout else 1 - HELDOUT_FRACTION)
            if used[heldout] + size > budget:
                continue
        text = _read_source(source) if isinstance(source, Path) else source
        if text:
            parts[heldout].append(Document(name, text))
            used[heldout] += size
    return Corpus(train=parts[False], heldout=parts[True])


# ---------------------------------------------------------------------- tokenizer


def train_tokenizer(documents: Sequence[Document], vocab_size: int) -> Tokenizer:
    """The recipe's byte-level BPE with <|endoftext|> as BOS as well as EOS (GPT-2's convention):
    training documents are joined as `<|endoftext|> doc <|endoftext|> doc ...`, so a prompt encoded
    with its BOS starts the way every training document did."""
    texts = (doc.text for doc in documents)
    return train_byte_level_bpe(texts, vocab_size, SPECIAL_TOKENS, ENDOFTEXT, length=len(documents))


def tokenizer_config() -> dict[str, Any]:
    return recipe_tokenizer_config(ENDOFTEXT, ENDOFTEXT, MAX_POSITION_EMBEDDINGS)


def special_token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise SystemExit(f"the tokenizer lacks the special token {token!r} (needed: {SPECIAL_TOKENS})")
    return int(token_id)


# ---------------------------------------------------------------------- token streams


def tokenize_stream(tokenizer: Tokenizer, documents: Sequence[Document]) -> np.ndarray:
    """All documents as one int32 stream, each preceded by <|endoftext|> (the post-processor's BOS)."""
    encodings = tokenizer.encode_batch([doc.text for doc in documents], add_special_tokens=True)
    if not encodings:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate([np.asarray(enc.ids, dtype=np.int32) for enc in encodings])


def corpus_key(tokenizer: Tokenizer, max_corpus_bytes: int | None) -> str:
    """Names the cached streams: they depend on the tokenizer, the cap and this Python's stdlib."""
    spec = json.dumps([max_corpus_bytes, HELDOUT_FRACTION, sysconfig.get_paths()["stdlib"], sys.version])
    return hashlib.sha256((tokenizer.to_str() + spec).encode("utf-8")).hexdigest()[:16]


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def load_or_build_streams(
    out: Path, tokenizer: Tokenizer, max_corpus_bytes: int | None, corpus: Callable[[], Corpus]
) -> tuple[np.ndarray, np.ndarray]:
    """(train stream, held-out stream), from DIR's cache or tokenized now and cached."""
    key = corpus_key(tokenizer, max_corpus_bytes)
    paths = out / f"corpus_train.{key}.npy", out / f"corpus_heldout.{key}.npy"
    if all(path.is_file() for path in paths):
        return np.load(paths[0]), np.load(paths[1])
    started = time.perf_counter()
    parts = corpus()
    streams = tokenize_stream(tokenizer, parts.train), tokenize_stream(tokenizer, parts.heldout)
    for path, stream in zip(paths, streams, strict=True):
        _save_npy_atomic(path, stream)
    print(
        f"tokenized {len(parts.train)} train / {len(parts.heldout)} held-out documents into "
        f"{len(streams[0]):,} / {len(streams[1]):,} tokens in {time.perf_counter() - started:.1f}s"
    )
    return streams


# ---------------------------------------------------------------------- model


def llama_config(shape: ModelShape, vocab_size: int, endoftext_id: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=endoftext_id,
        eos_token_id=endoftext_id,
    )


def build_model(config: Any, seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)  # the initial weights depend on --seed only
    model: torch.nn.Module = LlamaForCausalLM(config)
    return model.train()


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    # Decay matrices (projections, the embedding) only: decaying RMSNorm gains would pull them towards
    # 0, i.e. towards switching their layer's output off, which is not regularization.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS)


def lr_at(step: int, base_lr: float, warmup: int, total_steps: int) -> float:
    """Learning rate of step `step` (0-based): linear warmup to base_lr, cosine down to 10% of it."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    min_lr = base_lr * MIN_LR_FRACTION
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def _generator(seed: int, purpose: str, step: int = 0) -> torch.Generator:
    # A fresh generator per (seed, purpose, step): a batch never depends on what was drawn before it,
    # which is what makes --resume reproduce the uninterrupted run.
    digest = hashlib.sha256(f"{seed}:{purpose}:{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big"))


def sample_windows(
    stream: torch.Tensor, count: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """`count` random windows of seq_len + 1 tokens of `stream`: [count, seq_len + 1] int64."""
    window = seq_len + 1
    if len(stream) < window:
        raise SystemExit(f"a token stream of {len(stream)} tokens is shorter than one window ({window})")
    starts = torch.randint(0, len(stream) - window + 1, (count,), generator=generator)
    return stream[starts[:, None] + torch.arange(window)].long()


# The shortest span with_repeats restates: about a line of code (a repeated 2-token span is a
# stutter, not a restatement).
MIN_REPEAT_SPAN = 16


def with_repeats(windows: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """A `fraction` of the windows [B, W] get their tail overwritten by a repeat of an earlier span of
    themselves: from a split point s (uniform in [W/4, 3W/4)) on, the tokens [r, s) (r uniform in
    [0, s - MIN_REPEAT_SPAN]) are written out again, periodically if the tail is longer. Text that
    restates text in its context (code edits, quotes, a function written out again) is where a
    target's next token is a copy; a distilled draft then sees how the target continues such text."""
    count, width = windows.shape
    chosen = torch.rand(count, generator=generator) < fraction
    splits = torch.randint(width // 4, 3 * width // 4, (count,), generator=generator)
    sources = (torch.rand(count, generator=generator) * (splits - MIN_REPEAT_SPAN + 1).clamp(min=1)).long()
    out = windows.clone()
    for i in torch.nonzero(chosen).flatten().tolist():
        split, source = int(splits[i]), int(sources[i])
        period = torch.arange(width - split) % (split - source) + source
        out[i, split:] = windows[i, period]
    return out


def next_token_logits(model: torch.nn.Module, windows: torch.Tensor, autocast: bool) -> torch.Tensor:
    """fp32 logits [B, T, V] of windows[:, :-1] [B, T]: the matmuls in bf16 under autocast, the
    softmaxes that follow in fp32 whatever they ran in (bf16 log-probabilities lose ~3 digits)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits  # [B, T, V]
    return logits.float()


def mean_token_loss(model: torch.nn.Module, windows: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Mean next-token cross-entropy over windows [B, T + 1] (inputs [:, :-1], targets [:, 1:])."""
    logits = next_token_logits(model, windows, autocast)
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


def distillation_loss(
    student: torch.nn.Module, teacher: torch.nn.Module, windows: torch.Tensor, autocast: bool
) -> torch.Tensor:
    """Mean over the positions of windows[:, :-1] of KL(teacher || student) between the next-token
    distributions: forward KL, so the student spreads its mass wherever the teacher puts some (the
    exact rejection rule accepts a draft token with probability min(1, p/q): mass the draft lacks is
    what rejects, mode-seeking would keep only the argmax)."""
    with torch.no_grad():
        teacher_logp = F.log_softmax(next_token_logits(teacher, windows, autocast).flatten(0, 1), dim=-1)
    student_logp = F.log_softmax(next_token_logits(student, windows, autocast).flatten(0, 1), dim=-1)
    return F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean")


def load_teacher(path: Path, tokenizer: Tokenizer) -> torch.nn.Module:
    """A trained checkpoint on this run's tokenizer, in eval mode, its weights frozen."""
    from transformers import AutoModelForCausalLM

    own = path / "tokenizer.json"
    if not own.is_file() or Tokenizer.from_file(str(own)).to_str() != tokenizer.to_str():
        raise SystemExit(f"--teacher {path}: its tokenizer.json differs from this run's tokenizer")
    with hf_progress_bars_disabled():
        teacher: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    teacher.eval().requires_grad_(False)
    return teacher


def load_init_weights(model: torch.nn.Module, path: Path) -> None:
    """Start from DIR/model.safetensors (same shape) instead of random weights."""
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    # A tied-embedding checkpoint stores the embedding once; lm_head.weight is that same tensor.
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(
            f"--init {path}: not this model's shape (missing {missing}, unexpected {unexpected})"
        )


@torch.no_grad()
def heldout_evaluation(
    model: torch.nn.Module,
    teacher: torch.nn.Module | None,
    eval_windows: torch.Tensor,
    batch_size: int,
    autocast: bool,
) -> tuple[float, float | None]:
    """(perplexity, greedy agreement with the teacher or None) over the held-out windows, from one
    forward of the model per batch. Agreement: the fraction of positions where the model's and the
    teacher's argmax next tokens agree (teacher-forced), the greedy acceptance rate a draft can
    expect on text like this."""
    model.eval()
    loss_sum, agree = 0.0, 0
    for batch in eval_windows.split(batch_size):
        logits = next_token_logits(model, batch, autocast)  # [b, T, V]
        loss_sum += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item() * len(batch)
        if teacher is not None:
            agree += int((logits.argmax(-1) == next_token_logits(teacher, batch, autocast).argmax(-1)).sum())
    model.train()
    perplexity = math.exp(loss_sum / len(eval_windows))
    positions = eval_windows.shape[0] * (eval_windows.shape[1] - 1)
    return perplexity, None if teacher is None else agree / positions


# ---------------------------------------------------------------------- state and outputs

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.json"
# Arguments that define the training trajectory: a resumed run must use the saved values.
TRAJECTORY_ARGS = (
    "size",
    "steps",
    "seq_len",
    "batch_size",
    "lr",
    "warmup",
    "seed",
    "max_corpus_bytes",
    "vocab_size",
    "autocast",
    "teacher",
    "init",
    "repeat_fraction",
)


@dataclass
class Progress:
    """What a resumed run continues from (saved in train_state.pt beside the weights)."""

    step: int = 0  # steps completed
    tokens_seen: int = 0  # predicted tokens (batch_size x seq_len per step)
    elapsed_s: float = 0.0  # wall time over all sessions
    losses: list[float] = field(default_factory=list)  # train loss of every step
    # {step, train_loss, heldout_ppl[, agreement]}
    history: list[dict[str, float]] = field(default_factory=list)


def save_state(
    out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: Progress, args: dict
) -> None:
    # Written to a temporary file and renamed: an interruption mid-write leaves the previous state.
    tmp = out / (STATE_FILE + ".tmp")
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "progress": asdict(progress),
        "args": args,
    }
    torch.save(state, tmp)
    os.replace(tmp, out / STATE_FILE)


def load_state(out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: dict) -> Progress:
    state = torch.load(out / STATE_FILE, weights_only=True)
    mismatched = {
        k: (state["args"].get(k), args[k]) for k in TRAJECTORY_ARGS if state["args"].get(k) != args[k]
    }
    if mismatched:
        details = ", ".join(
            f"--{k.replace('_', '-')} was {saved!r}, now {now!r}" for k, (saved, now) in mismatched.items()
        )
        raise SystemExit(f"cannot resume {out / STATE_FILE}: {details}")
    if state["args"].get("threads") != args["threads"]:
        print("warning: --threads differs from the saved run; results will not be bit-identical to it")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return Progress(**state["progress"])


def export_checkpoint(out: Path, model: torch.nn.Module, tokenizer: Tokenizer) -> None:
    """Write the Hugging Face checkpoint files (weights in bf16) into `out`, each replaced atomically."""
    from transformers import GenerationConfig

    endoftext, im_end = special_token_id(tokenizer, ENDOFTEXT), special_token_id(tokenizer, IM_END)
    # A bf16 copy: the fp32 master weights stay untouched. Any: transformers' own model type.
    export: Any = copy.deepcopy(model).to(torch.bfloat16).eval()
    export.config.dtype = torch.bfloat16
    # A base model ends a document with <|endoftext|>; a chat turn ends with <|im_end|>.
    export.generation_config = GenerationConfig(bos_token_id=endoftext, eos_token_id=[endoftext, im_end])
    staging = out / ".export.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    with hf_progress_bars_disabled():  # a "Writing model shards" bar at every save would break ours
        export.save_pretrained(staging, safe_serialization=True)
    tokenizer.save(str(staging / "tokenizer.json"))
    _write_json(staging / "tokenizer_config.json", tokenizer_config())
    for file in staging.iterdir():
        os.replace(file, out / file.name)
    staging.rmdir()


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------- progress display


class ProgressDisplay:
    """A tqdm bar with the loss, or a line every PRINT_EVERY steps where tqdm is not installed."""

    def __init__(self, total: int, initial: int) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self._total = total

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:.0f}", refresh=False
            )
            self._bar.update(1)
        elif step % PRINT_EVERY == 0 or step == self._total:
            print(
                f"step {step}/{self._total} loss {loss:.3f} lr {lr:.2e} {tokens_per_s:.0f} tok/s", flush=True
            )

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    parser.add_argument(
        "--size", choices=sorted(SIZES), required=True, help="model preset (tiny: tests only)"
    )
    parser.add_argument("--tokenizer", type=Path, help="reuse DIR/tokenizer.json instead of training one")
    parser.add_argument(
        "--vocab-size", type=int, help=f"BPE vocabulary when training one (default {DEFAULT_VOCAB_SIZE})"
    )
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (sets the LR schedule)")
    parser.add_argument(
        "--stop-after", type=int, help="stop (state saved) after this step, schedule unchanged"
    )
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=200, help="held-out evaluation interval (steps)")
    parser.add_argument("--save-every", type=int, default=200, help="train_state.pt + checkpoint interval")
    parser.add_argument("--resume", action="store_true", help="continue from DIR/train_state.pt if present")
    parser.add_argument("--max-corpus-bytes", type=int, help="cap the corpus (tests)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--autocast", choices=("bf16", "fp32"), default=DEFAULT_AUTOCAST, help="matmul precision"
    )
    parser.add_argument(
        "--teacher", type=Path, help="distil from this checkpoint (KL to its next-token distributions)"
    )
    parser.add_argument("--init", type=Path, help="start from this checkpoint's weights (same --size)")
    parser.add_argument(
        "--repeat-fraction",
        type=float,
        default=0.0,
        help="fraction of training windows whose tail repeats an earlier span (with_repeats)",
    )
    args = parser.parse_args(argv)
    if args.size == "draft" and args.tokenizer is None:
        parser.error("--size draft needs --tokenizer TARGET_DIR: a draft must share its target's vocabulary")
    if args.tokenizer is not None and args.vocab_size is not None:
        parser.error("--vocab-size applies to a trained tokenizer, not to one reused with --tokenizer")
    for name in ("steps", "seq_len", "batch_size", "eval_every", "save_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.seq_len > MAX_POSITION_EMBEDDINGS:
        parser.error(f"--seq-len exceeds max_position_embeddings ({MAX_POSITION_EMBEDDINGS})")
    return args


def _args_record(args: argparse.Namespace) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def prepare_tokenizer(args: argparse.Namespace, resuming: bool, corpus: Callable[[], Corpus]) -> Tokenizer:
    """The run's own when resuming, else --tokenizer's, else one trained on the train part now."""
    own = args.out / "tokenizer.json"
    if resuming and own.is_file():
        tokenizer = Tokenizer.from_file(str(own))
        given = args.tokenizer / "tokenizer.json" if args.tokenizer is not None else None
        if given is not None and Tokenizer.from_file(str(given)).to_str() != tokenizer.to_str():
            raise SystemExit(f"cannot resume: {given} differs from the tokenizer this run used ({own})")
    elif args.tokenizer is not None:
        tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    else:
        started = time.perf_counter()
        vocab_size = args.vocab_size or DEFAULT_VOCAB_SIZE
        tokenizer = train_tokenizer(corpus().train, vocab_size)
        print(f"trained a {vocab_size}-token BPE in {time.perf_counter() - started:.1f}s")
    for token in SPECIAL_TOKENS:
        special_token_id(tokenizer, token)
    tokenizer.save(str(own))
    _write_json(args.out / "tokenizer_config.json", tokenizer_config())
    return tokenizer


def train(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Run (or resume) one training; returns what train_log.json records."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if (out / STATE_FILE).is_file() and not args.resume:
        raise SystemExit(f"{out / STATE_FILE} exists: pass --resume to continue it, or choose another --out")
    resuming = args.resume and (out / STATE_FILE).is_file()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    corpus_cache: list[Corpus] = []

    def corpus() -> Corpus:  # read at most once, and only if the tokenizer or the streams need it
        if not corpus_cache:
            corpus_cache.append(collect_corpus(args.max_corpus_bytes))
        return corpus_cache[0]

    tokenizer = prepare_tokenizer(args, resuming, corpus)
    train_np, heldout_np = load_or_build_streams(out, tokenizer, args.max_corpus_bytes, corpus)
    train_stream, heldout_stream = torch.from_numpy(train_np), torch.from_numpy(heldout_np)

    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    shape = SIZES[args.size]
    model = build_model(llama_config(shape, vocab_size, special_token_id(tokenizer, ENDOFTEXT)), args.seed)
    _report_parameters(model, shape, vocab_size, args.size)
    if args.init is not None and not resuming:  # a resumed run's state holds the weights
        load_init_weights(model, args.init)
    teacher = load_teacher(args.teacher, tokenizer) if args.teacher is not None else None
    optimizer = make_optimizer(model, args.lr)
    record = _args_record(args)
    progress = load_state(out, model, optimizer, record) if resuming else Progress()
    if resuming:
        print(f"resuming at step {progress.step}")

    eval_windows = sample_windows(
        heldout_stream, EVAL_WINDOWS, args.seq_len, _generator(args.seed, "heldout")
    )
    session = _train_loop(args, model, teacher, optimizer, progress, train_stream, eval_windows, tokenizer)
    log = _train_log(args, argv, progress, session, shape, vocab_size, len(train_np), len(heldout_np))
    _write_json(out / LOG_FILE, log)
    return log


@dataclass
class Session:
    """This invocation's own numbers (the Progress spans all sessions)."""

    tokens: int = 0
    step_time_s: float = 0.0  # time inside training steps only (no evaluation, no saving)

    @property
    def tokens_per_s(self) -> float:
        return 0.0 if self.step_time_s == 0 else self.tokens / self.step_time_s


def _train_loop(
    args: argparse.Namespace,
    model: torch.nn.Module,
    teacher: torch.nn.Module | None,
    optimizer: torch.optim.AdamW,
    progress: Progress,
    train_stream: torch.Tensor,
    eval_windows: torch.Tensor,
    tokenizer: Tokenizer,
) -> Session:
    autocast = args.autocast == "bf16"
    last_step = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    session, display = Session(), ProgressDisplay(args.steps, progress.step)
    session_start = time.perf_counter()
    elapsed_before = progress.elapsed_s
    while progress.step < last_step:
        started = time.perf_counter()
        loss, lr = _train_step(args, model, teacher, optimizer, progress.step, train_stream, autocast)
        session.step_time_s += time.perf_counter() - started
        session.tokens += args.batch_size * args.seq_len
        progress.step += 1
        progress.tokens_seen += args.batch_size * args.seq_len
        progress.losses.append(loss)
        display.update(progress.step, loss, lr, session.tokens_per_s)
        progress.elapsed_s = elapsed_before + time.perf_counter() - session_start
        done = progress.step == last_step
        if progress.step % args.eval_every == 0 or done:
            _evaluate(args, model, teacher, progress, eval_windows, display, autocast)
        if progress.step % args.save_every == 0 or done:
            save_state(args.out, model, optimizer, progress, _args_record(args))
            export_checkpoint(args.out, model, tokenizer)
    display.close()
    return session


def _train_step(
    args: argparse.Namespace,
    model: torch.nn.Module,
    teacher: torch.nn.Module | None,
    optimizer: torch.optim.AdamW,
    step: int,
    train_stream: torch.Tensor,
    autocast: bool,
) -> tuple[float, float]:
    """One optimizer step on the batch of `step`; returns (loss, learning rate)."""
    lr = lr_at(step, args.lr, args.warmup, args.steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    windows = sample_windows(
        train_stream, args.batch_size, args.seq_len, _generator(args.seed, "train", step)
    )
    if args.repeat_fraction > 0:
        windows = with_repeats(windows, args.repeat_fraction, _generator(args.seed, "repeats", step))
    if teacher is None:
        loss = mean_token_loss(model, windows, autocast)
    else:
        loss = distillation_loss(model, teacher, windows, autocast)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP_NORM)
    optimizer.step()
    return loss.item(), lr


def _evaluate(
    args: argparse.Namespace,
    model: torch.nn.Module,
    teacher: torch.nn.Module | None,
    progress: Progress,
    eval_windows: torch.Tensor,
    display: ProgressDisplay,
    autocast: bool,
) -> None:
    perplexity, agreement = heldout_evaluation(model, teacher, eval_windows, args.batch_size, autocast)
    # Over a fixed window (not "since the last evaluation"), so that the extra evaluation at a
    # --stop-after point leaves the later entries of a resumed run equal to an uninterrupted run's.
    recent = progress.losses[-args.eval_every :]
    train_loss = sum(recent) / len(recent)
    entry = {"step": progress.step, "train_loss": train_loss, "heldout_ppl": perplexity}
    message = f"step {progress.step}: train loss {train_loss:.3f}, held-out perplexity {perplexity:.2f}"
    if agreement is not None:
        entry["agreement"] = agreement
        message += f", greedy agreement with the teacher {agreement:.1%}"
    progress.history.append(entry)
    display.write(message)


def _report_parameters(model: torch.nn.Module, shape: ModelShape, vocab_size: int, size: str) -> None:
    # parameters() yields the tied embedding / lm_head weight once.
    built = sum(p.numel() for p in model.parameters())
    expected = count_parameters(shape, vocab_size)
    if built != expected:
        raise RuntimeError(f"the built model has {built} parameters, count_parameters says {expected}")
    embedding = vocab_size * shape.hidden_size
    print(
        f"{size}: {built / 1e6:.2f}M parameters ({embedding / 1e6:.2f}M tied embedding); hidden "
        f"{shape.hidden_size}, {shape.num_hidden_layers} layers, {shape.num_attention_heads} query / "
        f"{shape.num_key_value_heads} KV heads of {HEAD_DIM}, MLP {shape.intermediate_size}, "
        f"vocab {vocab_size}"
    )


def _train_log(
    args: argparse.Namespace,
    argv: Sequence[str],
    progress: Progress,
    session: Session,
    shape: ModelShape,
    vocab_size: int,
    train_tokens: int,
    heldout_tokens: int,
) -> dict[str, Any]:
    final = progress.history[-1] if progress.history else {}
    recent = progress.losses[-FINAL_LOSS_WINDOW:]
    return {
        "command": [sys.executable, __file__, *argv],
        "seed": args.seed,
        "size": args.size,
        "parameters": count_parameters(shape, vocab_size),
        "shape": {**asdict(shape), "intermediate_size": shape.intermediate_size, "head_dim": HEAD_DIM},
        "vocab_size": vocab_size,
        "autocast": args.autocast,
        "threads": torch.get_num_threads(),
        "corpus_tokens": {"train": train_tokens, "heldout": heldout_tokens},
        "steps": progress.step,
        "steps_planned": args.steps,
        "tokens_seen": progress.tokens_seen,
        "wall_time_s": round(progress.elapsed_s, 2),
        "session_tokens_per_s": round(session.tokens_per_s, 1),
        "first_train_loss": progress.losses[0] if progress.losses else None,
        "final_train_loss": sum(recent) / len(recent) if recent else None,
        "heldout_perplexity": final.get("heldout_ppl"),
        "teacher_agreement": final.get("agreement"),
        "history": progress.history,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    log = train(args, argv)
    print(
        f"done: {log['steps']} steps, {log['tokens_seen']:,} tokens, final train loss "
        f"{log['final_train_loss']:.3f}, held-out perplexity {log['heldout_perplexity']:.2f}, "
        f"{log['session_tokens_per_s']:.0f} tok/s; checkpoint in {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
