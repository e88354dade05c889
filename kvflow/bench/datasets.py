"""Benchmark workloads: conversations of one or more turns, with input lengths exact in tokens.

Every workload is a list of `Conversation`s; single-turn workloads are conversations of one turn.
Random text is built from token ids and re-encoded until it is exactly the requested number of tokens
under the server's tokenizer (decode -> encode is not the identity for BPE: merges across the
boundaries of random ids change the count). For the completions endpoint the token ids themselves are
sent, exact by construction on any server that accepts token-id prompts.

Prompts never repeat across what a server could cache: the random generators are seeded with the
user's seed mixed with the run's shape (every DatasetSpec field; the token content also with a salt
naming the load), so two runs that differ only in lengths or load share no prefix (runs that differ
only in load draw the same lengths); and the warm-up requests are drawn from their own generator,
so no measured request finds a warm-up prompt in a prefix cache.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvflow.bench.multilingual import PARALLEL_TEXTS

DATASETS = ("random", "shared-prefix", "multi-turn", "long-context", "multilingual")
# Attempts at making decode(ids) re-encode to exactly the requested length before giving up.
MAX_EXACT_LENGTH_ATTEMPTS = 16
# long-context prompts leave this many tokens of the context unused (chat templates add a few).
LONG_CONTEXT_MARGIN = 64
LONG_CONTEXT_MAX_REQUESTS = 4
# Warm-up requests need the shape of the run's prompts (kernels, allocations), not its full outputs.
WARMUP_MAX_OUTPUT_TOKENS = 16


class BenchTokenizer(Protocol):
    """The slice of kvflow.tokenizer.Tokenizer the workloads need (the server's tokenizer)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class Turn:
    """One request: a user message (chat) or prompt (completions), and its output budget."""

    text: str
    max_tokens: int
    token_ids: list[int] | None = None  # the exact ids of `text` when built from ids
    num_tokens: int | None = None  # tokens of `text` (without chat template or BOS)


@dataclass
class Conversation:
    turns: list[Turn]
    system: str | None = None  # a system prompt (shared-prefix puts the shared tokens here)
    system_token_ids: list[int] | None = None
    language: str | None = None


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # one of DATASETS, or "jsonl:PATH"
    num_requests: int
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [L * (1 - r), L * (1 + r)]
    prefix_len: int = 0  # shared-prefix: tokens of the shared system prompt
    num_turns: int = 3  # multi-turn: user turns per conversation
    max_model_len: int | None = None  # long-context: the server's context length
    seed: int = 0


@dataclass
class Workload:
    conversations: list[Conversation]
    notes: list[str] = field(default_factory=list)
    warmup: list[Conversation] = field(default_factory=list)  # sent first, excluded, never measured

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def workload_seed(spec: DatasetSpec, salt: str = "") -> int:
    """The generator's seed: the user's seed mixed with the run's shape and `salt` (stable across
    processes, unlike hash()), so a different length, count or load draws different prompts."""
    shape = json.dumps({**asdict(spec), "salt": salt}, sort_keys=True)
    return int.from_bytes(hashlib.sha256(shape.encode()).digest()[:8], "big")


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


class RandomText:
    """Random token ids that decode to text re-encoding to exactly the same number of tokens."""

    def __init__(self, tokenizer: BenchTokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        special = set(tokenizer.all_special_ids)
        # Tokens that survive decode -> encode alone (no partial UTF-8 sequence, no normalization):
        # random sequences of them almost always round-trip, so the exact-length search converges.
        self.candidates = [
            i for i in range(tokenizer.vocab_size) if i not in special and _round_trips(tokenizer, i)
        ]
        if not self.candidates:
            raise ValueError("the tokenizer has no ordinary tokens to build random prompts from")

    def with_rng(self, rng: random.Random) -> RandomText:
        """The same candidate tokens (the vocabulary scan is the slow part), another generator."""
        other = RandomText.__new__(RandomText)
        other.tokenizer, other.rng, other.candidates = self.tokenizer, rng, self.candidates
        return other

    def ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.candidates) for _ in range(n)]

    def exact(self, num_tokens: int) -> tuple[str, list[int], int]:
        """(text, ids, tokens of text): `ids` has exactly `num_tokens` ids and `text` is their decoding;
        the text re-encodes to the same count unless merges across random boundaries defeat every
        attempt (then the third value says how many tokens the text really is)."""
        ids = self.ids(num_tokens)
        for _ in range(MAX_EXACT_LENGTH_ATTEMPTS):
            text = self.tokenizer.decode(ids)
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == num_tokens:
                return text, encoded, num_tokens
            # Too long: cut; too short: pad with fresh random ids; then check the round trip again.
            ids = encoded[:num_tokens] + self.ids(max(0, num_tokens - len(encoded)))
        text = self.tokenizer.decode(ids)
        return text, ids, len(self.tokenizer.encode(text, add_special_tokens=False))


def _round_trips(tokenizer: BenchTokenizer, token_id: int) -> bool:
    text = tokenizer.decode([token_id])
    return (
        bool(text.strip())
        and "\ufffd" not in text
        and tokenizer.encode(text, add_special_tokens=False) == [token_id]
    )


def build_workload(
    spec: DatasetSpec, tokenizer: BenchTokenizer | None, num_warmup: int = 0, salt: str = ""
) -> Workload:
    """The run's conversations and `num_warmup` warm-up conversations that share no prefix with
    them; `salt` names what else makes this run distinct (the load), see workload_seed."""
    seed = workload_seed(spec, salt)
    if spec.name.startswith("jsonl:") or spec.name == "multilingual":
        if spec.name == "multilingual":
            workload = _multilingual(spec)
        else:
            workload = _jsonl(Path(spec.name[len("jsonl:") :]), spec)
        workload.warmup = _text_warmup(workload, num_warmup, random.Random(seed + 1))
        return workload
    if spec.name not in DATASETS:
        raise ValueError(f"unknown dataset {spec.name!r}; known: {', '.join(DATASETS)}, jsonl:PATH")
    if tokenizer is None:
        raise ValueError(f"the {spec.name} dataset builds prompts from token ids: give --tokenizer MODEL_DIR")
    # Lengths from the user's seed and the run's shape; token content salted too (the load): runs at
    # other loads get other prompts of the same lengths, paired workloads without shared prefixes.
    rng = random.Random(workload_seed(spec))
    text = RandomText(tokenizer, random.Random(seed))
    if spec.name == "random":
        workload = _random(spec, text, rng)
    elif spec.name == "shared-prefix":
        workload = _shared_prefix(spec, text, rng)
    elif spec.name == "multi-turn":
        workload = _multi_turn(spec, text, rng)
    else:
        workload = _long_context(spec, text)
    workload.warmup = _random_warmup(workload, num_warmup, text.with_rng(random.Random(seed + 1)))
    return workload


def _random_warmup(workload: Workload, n: int, text: RandomText) -> list[Conversation]:
    """Fresh random prompts as long as the run's first ones (its own generator: no shared prefix)."""
    firsts = [c.turns[0] for c in workload.conversations]
    warmup = []
    for i in range(n):
        turn = firsts[i % len(firsts)]
        length = turn.num_tokens or len(turn.token_ids or ()) or 1
        prompt, ids, text_len = text.exact(length)
        warmup.append(
            Conversation([Turn(prompt, min(turn.max_tokens, WARMUP_MAX_OUTPUT_TOKENS), ids, text_len)])
        )
    return warmup


def _text_warmup(workload: Workload, n: int, rng: random.Random) -> list[Conversation]:
    """Text datasets (no token ids): the first prompts' words shuffled behind a random tag, so a
    prefix cache finds nothing of them (the tag differs in the first block)."""
    warmup = []
    for i in range(n):
        turn = workload.conversations[i % len(workload.conversations)].turns[0]
        words = turn.text.split()
        rng.shuffle(words)
        text = f"[warm-up {rng.randrange(10**9):09d}] " + " ".join(words)
        warmup.append(Conversation([Turn(text, min(turn.max_tokens, WARMUP_MAX_OUTPUT_TOKENS))]))
    return warmup


def _random_turns(spec: DatasetSpec, text: RandomText, rng: random.Random, n: int) -> list[Turn]:
    turns = []
    in_lens = _lengths(rng, spec.input_len, spec.range_ratio, n)
    out_lens = _lengths(rng, spec.output_len, spec.range_ratio, n)
    for in_len, out_len in zip(in_lens, out_lens, strict=True):
        prompt, ids, text_len = text.exact(in_len)
        turns.append(Turn(prompt, out_len, ids, text_len))
    return turns


def _random(spec: DatasetSpec, text: RandomText, rng: random.Random) -> Workload:
    turns = _random_turns(spec, text, rng, spec.num_requests)
    return Workload([Conversation([t]) for t in turns])


def _shared_prefix(spec: DatasetSpec, text: RandomText, rng: random.Random) -> Workload:
    if spec.prefix_len < 1:
        raise ValueError("the shared-prefix dataset needs --prefix-len > 0")
    prefix, prefix_ids, _ = text.exact(spec.prefix_len)
    conversations = [
        Conversation([t], system=prefix, system_token_ids=prefix_ids)
        for t in _random_turns(spec, text, rng, spec.num_requests)
    ]
    note = f"shared-prefix: every request starts with the same {spec.prefix_len}-token system prompt"
    return Workload(conversations, [note])


def _multi_turn(spec: DatasetSpec, text: RandomText, rng: random.Random) -> Workload:
    num_conversations = max(1, spec.num_requests // max(spec.num_turns, 1))
    conversations = [
        Conversation(_random_turns(spec, text, rng, spec.num_turns)) for _ in range(num_conversations)
    ]
    note = (
        f"multi-turn: {num_conversations} conversations x {spec.num_turns} turns; each turn resends the "
        "history (earlier turns and the server's answers)"
    )
    return Workload(conversations, [note])


def _long_context(spec: DatasetSpec, text: RandomText) -> Workload:
    if spec.max_model_len is None:
        raise ValueError("long-context needs the server's context length (give --input-len explicitly)")
    prompt_len = spec.max_model_len - spec.output_len - LONG_CONTEXT_MARGIN
    if prompt_len < 1:
        raise ValueError(
            f"--output-len {spec.output_len} leaves no room in a context of {spec.max_model_len}"
        )
    n = min(spec.num_requests, LONG_CONTEXT_MAX_REQUESTS)
    turns = []
    for _ in range(n):
        prompt, ids, text_len = text.exact(prompt_len)
        turns.append(Turn(prompt, spec.output_len, ids, text_len))
    note = f"long-context: {n} prompts of {prompt_len} tokens (context {spec.max_model_len})"
    return Workload([Conversation([t]) for t in turns], [note])


def _multilingual(spec: DatasetSpec) -> Workload:
    languages = sorted(PARALLEL_TEXTS)
    conversations = []
    for i in range(spec.num_requests):
        language = languages[i % len(languages)]
        conversations.append(
            Conversation([Turn(PARALLEL_TEXTS[language], spec.output_len)], language=language)
        )
    note = f"multilingual: the same text in {len(languages)} languages ({', '.join(languages)})"
    return Workload(conversations, [note])


def _jsonl(path: Path, spec: DatasetSpec) -> Workload:
    """One JSON object per line: {"prompt": str} or {"messages": [...]}, optional "max_tokens"."""
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    conversations = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_no}: not JSON: {exc}") from exc
        max_tokens = int(item.get("max_tokens", spec.output_len))
        if isinstance(item.get("prompt"), str):
            conversations.append(Conversation([Turn(item["prompt"], max_tokens)]))
        elif isinstance(item.get("messages"), list) and item["messages"]:
            conversations.append(
                _conversation_from_messages(item["messages"], max_tokens, f"{path}:{line_no}")
            )
        else:
            raise ValueError(f"{path}:{line_no}: expected a 'prompt' string or a 'messages' list")
        if len(conversations) == spec.num_requests:
            break
    if not conversations:
        raise ValueError(f"{path} holds no requests")
    return Workload(conversations, [f"jsonl: {len(conversations)} requests from {path}"])


def _conversation_from_messages(messages: list[dict[str, Any]], max_tokens: int, where: str) -> Conversation:
    """A messages list becomes one request: the system message (if first) plus the user turns, joined."""
    system = None
    if messages[0].get("role") == "system":
        system = str(messages[0].get("content", ""))
        messages = messages[1:]
    users = [str(m.get("content", "")) for m in messages if m.get("role") == "user"]
    if not users:
        raise ValueError(f"{where}: no user message")
    return Conversation([Turn("\n\n".join(users), max_tokens)], system=system)
