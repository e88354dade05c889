"""One benchmark run: discover the server, build the workload, warm up, run the load, scrape the
server's metrics around it, and assemble the JSON result (schema in docs/metrics.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from kvflow.bench.arrivals import LoadSpec, run_load
from kvflow.bench.client import ClientConfig, Endpoint, Prompt, send_request, stream_session
from kvflow.bench.datasets import BenchTokenizer, Conversation, DatasetSpec, Workload, build_workload
from kvflow.bench.events import RequestRecord
from kvflow.bench.gauges import GaugeSamples, records_gauges, sample_gauges, window_gauges
from kvflow.bench.metrics import aggregate, request_metrics
from kvflow.bench.priority import assign_priorities, per_priority
from kvflow.bench.replicas import ReplicaScrapes
from kvflow.bench.server_metrics import Snapshot, engine_config, scrape
from kvflow.bench.server_steps import (
    ROW_STEP_KEYS,
    STEP_KEYS,
    dashboard_hello,
    last_step_time,
    recorded_steps,
    run_window,
    steps_after,
)
from kvflow.bench.server_view import server_section

# Granularity of the client-side repeated-prefix count: the block size of kvflow's and vLLM's
# prefix caches (a prefix is reusable only in whole blocks).
PREFIX_BLOCK_TOKENS = 16
# Requests whose input length is checked against the server's /tokenize before the run.
NUM_LENGTH_CHECKS = 8
HTTP_TIMEOUT_S = 3600.0  # a long-context request on a CPU can take minutes; the run decides


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. The metadata's help texts are `kvflow bench`'s (kvflow/arg_utils.py); fields
    without help (dataset, load, slo, progress) have hand-written flags in kvflow/bench/cli.py."""

    base_url: str = field(metadata={"help": "the server's OpenAI base URL"})
    dataset: DatasetSpec
    load: LoadSpec
    model: str | None = field(
        default=None, metadata={"help": "model name to request; unset: the first model the server lists"}
    )
    endpoint: Endpoint = field(default="completions", metadata={"help": "the OpenAI endpoint to load"})
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "model dir with tokenizer.json, or a GGUF file; unset: the server's, if local"},
    )
    slo: dict[str, float] = field(default_factory=dict)
    # Priority classes of the measured requests and their shares (kvflow/bench/priority.py).
    priority_mix: dict[int, float] = field(default_factory=dict)
    warmup: int = field(default=2, metadata={"help": "requests sent first and excluded"})
    api_key: str | None = field(default=None, metadata={"help": "sent as 'Authorization: Bearer KEY'"})
    ignore_eos: bool = field(
        default=True,
        metadata={"help": "ask the server to ignore EOS (--no-ignore-eos: let outputs stop at EOS)"},
    )
    continuous_usage_stats: bool = field(
        default=True,
        metadata={
            "flag": "--continuous-usage",  # --no-continuous-usage, the flag's name since the first release
            "help": "ask for token usage in every chunk (--no-continuous-usage: for servers that reject "
            "stream_options extensions)",
        },
    )
    include_usage: bool = field(
        default=True,
        metadata={
            "flag": "--usage",  # --no-usage, the flag's name since the first release
            "help": "ask for the final usage chunk (--no-usage: send no stream_options at all)",
        },
    )
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature of every request"})
    metrics_interval: float = field(
        default=0.5,
        metadata={
            "help": "seconds between /metrics samples during the run (gauges: running, waiting, "
            "KV usage); 0: only before and after. A kvflow server's gauges are read off its "
            "recorded steps instead (a scrape stalls the step it lands on)"
        },
    )
    progress: bool = True
    # The /metrics of each replica behind a router at base_url (kvflow bench --replica-metrics):
    # scraped around the run like the server's own, reported per replica (`replicas` in the result).
    replica_metrics: tuple[str, ...] = ()

    @property
    def server_root(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")


# What llama-server's /props says that the doctor uses (slots = its max_num_seqs).
PROPS_KEYS = ("total_slots", "model_ftype", "build_info")


@dataclass
class ServerInfo:
    model: str
    max_model_len: int | None
    root: str | None
    meta: dict[str, Any] = field(default_factory=dict)  # llama-server's model card `meta`
    props: dict[str, Any] = field(default_factory=dict)  # llama-server's /props, PROPS_KEYS only

    def as_json(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "root": self.root,
            "meta": self.meta,
            "props": self.props,
        }


def _get_json(url: str, headers: dict[str, str]) -> Any:
    try:
        response = httpx.get(url, headers=headers, timeout=30)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def discover(config: BenchConfig) -> ServerInfo:
    """The model to use and what /v1/models says about it (vLLM and kvflow give max_model_len, root;
    llama-server its model's size and context in `meta`, and its slots in /props)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    listed = _get_json(config.base_url.rstrip("/") + "/models", headers)
    cards = listed.get("data", []) if isinstance(listed, dict) else []
    card = next((c for c in cards if config.model in (None, c.get("id"))), None)
    model = config.model or (card or {}).get("id")
    if model is None:
        raise ValueError(f"{config.base_url}/models lists no model: give --model")
    card = card or {}
    props = _get_json(config.server_root + "/props", headers) if isinstance(card.get("meta"), dict) else None
    props = {k: props[k] for k in PROPS_KEYS if k in props} if isinstance(props, dict) else {}
    return ServerInfo(model, card.get("max_model_len"), card.get("root"), card.get("meta") or {}, props)


def load_tokenizer(config: BenchConfig, info: ServerInfo) -> BenchTokenizer | None:
    from kvflow.gguf.gguf_file import is_gguf_path
    from kvflow.tokenizer import Tokenizer

    # A checkpoint directory's tokenizer.json, or the tokenizer a GGUF file carries (the file a
    # llama-server or a kvflow server serves: `root` of kvflow's /v1/models).
    for candidate in (config.tokenizer, info.root):
        if candidate and ((Path(candidate) / "tokenizer.json").is_file() or is_gguf_path(candidate)):
            return Tokenizer.for_model(candidate)
    if config.tokenizer:
        raise ValueError(f"no tokenizer.json in {config.tokenizer} (nor is it a GGUF file)")
    return None


def turn_prompt(
    conversation: Conversation, turn_index: int, history: list[str], endpoint: Endpoint
) -> Prompt:
    """The request for turn `turn_index`: earlier turns and the server's answers (`history`) resent."""
    turn = conversation.turns[turn_index]
    if endpoint == "chat":
        messages = [{"role": "system", "content": conversation.system}] if conversation.system else []
        for i in range(turn_index):
            messages += [
                {"role": "user", "content": conversation.turns[i].text},
                {"role": "assistant", "content": history[i]},
            ]
        messages.append({"role": "user", "content": turn.text})
        chars = sum(len(m["content"] or "") for m in messages)
        return Prompt(turn.max_tokens, messages=messages, num_tokens=turn.num_tokens or 0, num_chars=chars)
    if turn_index == 0 and turn.token_ids is not None:  # exact: send the ids themselves
        ids = (conversation.system_token_ids or []) + turn.token_ids
        chars = len(conversation.system or "") + len(turn.text)
        return Prompt(turn.max_tokens, prompt=ids, num_tokens=len(ids), num_chars=chars)
    parts = [conversation.system] if conversation.system else []
    for i in range(turn_index):
        parts += [conversation.turns[i].text, history[i]]
    text = "\n\n".join([*parts, turn.text])
    return Prompt(turn.max_tokens, prompt=text, num_tokens=turn.num_tokens or 0, num_chars=len(text))


class Progress:
    """tqdm when installed, else one line per 10% on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar: Any = None
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr)

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif (
            self.enabled and self.total and self.done * 10 // self.total != (self.done - 1) * 10 // self.total
        ):
            print(f"[kvflow bench] {self.done}/{self.total} requests", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Runner:
    def __init__(self, config: BenchConfig, info: ServerInfo, tokenizer: BenchTokenizer | None) -> None:
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.client_config = ClientConfig(
            base_url=config.base_url,
            model=info.model,
            endpoint=config.endpoint,
            api_key=config.api_key,
            ignore_eos=config.ignore_eos,
            continuous_usage_stats=config.continuous_usage_stats,
            include_usage=config.include_usage,
            temperature=config.temperature,
        )
        self.records: list[RequestRecord] = []
        self.warnings: list[str] = []
        self.before: Snapshot | None = None  # /metrics around the measured part of the run
        self.after: Snapshot | None = None
        self.replicas = ReplicaScrapes(config.replica_metrics)
        self._seen_prefix_blocks: set[int] = set()  # chained hashes of prompt blocks sent so far
        self.gauges = GaugeSamples()  # /metrics gauges sampled during the measured requests
        self.priorities: list[int | None] = []  # per measured conversation (set by run)
        # A kvflow server's steps during the measured part: [dur_ms, prefill_tokens, decode_tokens,
        # attention] (kvflow/bench/server_steps.py).
        self.step_records: list[list[float]] = []
        self.window: dict[str, Any] | None = None  # the server's record of the run's requests
        # Each request's x-request-id: this run's tag and the request's index, unique on the server.
        self.request_id_prefix = f"kvflow-bench-{uuid.uuid4().hex[:8]}-"

    def count_tokens(self) -> Callable[[str], int] | None:
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))

    def shared_prefix_tokens(self, prompt: Prompt) -> int | None:
        """Leading tokens of `prompt` that an earlier request already sent, in whole blocks (what an
        ideal prefix cache could reuse); records this prompt's blocks for the requests after it."""
        if isinstance(prompt.prompt, list):
            ids: list[int] = prompt.prompt
        elif self.tokenizer is None:
            return None
        else:
            text = (
                prompt.prompt if prompt.messages is None else "\n".join(m["content"] for m in prompt.messages)
            )
            ids = self.tokenizer.encode(text or "", add_special_tokens=False)
        shared, chain, still_shared = 0, 0, True
        for start in range(0, len(ids) - PREFIX_BLOCK_TOKENS + 1, PREFIX_BLOCK_TOKENS):
            chain = hash((chain, tuple(ids[start : start + PREFIX_BLOCK_TOKENS])))
            if still_shared and chain in self._seen_prefix_blocks:
                shared += PREFIX_BLOCK_TOKENS
            else:
                still_shared = False
                self._seen_prefix_blocks.add(chain)
        return shared

    async def run_conversation(
        self,
        session: aiohttp.ClientSession,
        conversation: Conversation,
        index: int,
        warmup: bool,
        progress: Progress | None,
    ) -> None:
        history: list[str] = []
        for t in range(len(conversation.turns)):
            prompt = turn_prompt(conversation, t, history, self.config.endpoint)
            if not warmup and index < len(self.priorities):
                prompt.priority = self.priorities[index]
            record = RequestRecord(
                len(self.records), 0.0, 0, is_warmup=warmup, language=conversation.language
            )
            record.x_request_id = f"{self.request_id_prefix}{record.index}"
            if len(conversation.turns) > 1:
                record.conversation, record.turn = index, t
            self.records.append(record)
            record.shared_prefix_tokens = self.shared_prefix_tokens(prompt)
            await send_request(session, self.client_config, prompt, record, self.count_tokens())
            if progress is not None:
                progress.update()
            if record.error is not None:
                return  # later turns need this answer
            history.append(record.output_text)

    async def run(self, workload: Workload) -> float:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        # The requests stream through aiohttp (kvflow/bench/client.py: a third of httpx's cost per
        # chunk); the gauge samplers, a few requests a second, through httpx.
        async with (
            httpx.AsyncClient(
                base_url=self.config.base_url, timeout=HTTP_TIMEOUT_S, limits=limits, headers=headers
            ) as http,
            stream_session(HTTP_TIMEOUT_S) as session,
        ):
            # Warm-up prompts share no prefix with the measured ones (kvflow/bench/datasets.py): a
            # prefix cache must not serve measured requests from what the warm-up left behind.
            for i, conversation in enumerate(workload.warmup):
                await self.run_conversation(session, conversation, i, True, None)
            metrics_url = self.config.server_root + "/metrics"
            self.before = scrape(metrics_url, headers)
            steps_hello = dashboard_hello(self.config.server_root, headers)
            steps_before = recorded_steps(steps_hello)
            self.replicas.scrape_before(headers)
            samplers = []
            # A kvflow server records its gauges with every step (window_gauges reads them after the
            # run): scraping it during the load would stall the steps being measured.
            sampled = self.before is not None and self.config.metrics_interval > 0
            from_window = sampled and records_gauges(steps_hello)
            if sampled and not from_window:
                samplers.append(sample_gauges(http, metrics_url, self.config.metrics_interval, self.gauges))
            if self.config.metrics_interval > 0:
                samplers += self.replicas.samplers(http, self.config.metrics_interval)
            sampler = asyncio.gather(*samplers) if samplers else None
            progress = Progress(workload.num_requests, self.config.progress)
            try:
                duration = await run_load(
                    len(workload.conversations),
                    self.config.load,
                    lambda i: self.run_conversation(session, workload.conversations[i], i, False, progress),
                )
            finally:
                progress.close()
                if sampler is not None:
                    sampler.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await sampler
            self.after = scrape(metrics_url, headers)
            if steps_before is not None:
                start = last_step_time(steps_before)
                hello = dashboard_hello(self.config.server_root, headers)
                self.step_records = steps_after(recorded_steps(hello), start)
                self.window = run_window(hello, start)
                if from_window:
                    self.gauges = window_gauges(self.window) or self.gauges
            self.replicas.scrape_after(headers)
        return duration


def check_input_lengths(config: BenchConfig, workload: Workload, warnings: list[str]) -> None:
    """Compare the workload's token counts with the server's /tokenize (kvflow, vLLM) on a sample."""
    url = config.server_root + "/tokenize"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    mismatches = []
    for conversation in workload.conversations[:NUM_LENGTH_CHECKS]:
        turn = conversation.turns[0]
        if turn.num_tokens is None:
            continue
        try:
            response = httpx.post(
                url, json={"prompt": turn.text, "add_special_tokens": False}, headers=headers
            )
        except httpx.HTTPError:
            return
        if response.status_code != 200 or "count" not in response.json():
            return  # no /tokenize on this server: the local tokenizer is all there is
        if response.json()["count"] != turn.num_tokens:
            mismatches.append((turn.num_tokens, response.json()["count"]))
    if mismatches:
        warnings.append(
            f"input lengths differ from the server's /tokenize on {len(mismatches)} of the first requests "
            f"(local, server): {mismatches[:3]}: is --tokenizer the server's tokenizer?"
        )


def count_with_server_tokenizer(config: BenchConfig, records: list[RequestRecord]) -> None:
    """Requests without server usage: count their output with the server's /tokenize when it has one
    (kvflow, vLLM), which beats the local tokenizer (the second fallback) and one-per-chunk."""
    pending = [r for r in records if r.succeeded and r.token_count_source == "local" and r.output_text]
    if not pending:
        return
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    for record in pending:
        body = {"prompt": record.output_text, "add_special_tokens": False}
        try:
            response = httpx.post(config.server_root + "/tokenize", json=body, headers=headers, timeout=30)
        except httpx.HTTPError:
            return
        if response.status_code != 200 or "count" not in response.json():
            return  # no /tokenize here: keep the local counts
        record.output_tokens = int(response.json()["count"])
        record.token_count_source = "tokenize"


def check_output_counts(
    records: list[RequestRecord], tokenizer: BenchTokenizer | None, warnings: list[str]
) -> None:
    """Server usage is the source of truth; say so when the local tokenizer disagrees with it."""
    if tokenizer is None:
        if any(r.token_count_source == "local" for r in records):
            warnings.append("no server usage and no tokenizer: output tokens counted as one per chunk")
        return
    disagree = 0
    for r in records:
        if r.succeeded and r.token_count_source == "usage":
            local = len(tokenizer.encode(r.output_text, add_special_tokens=False))
            disagree += abs(local - r.output_tokens) > 1  # one token of slack: a stop token has no text
    if disagree:
        warnings.append(
            f"{disagree} requests: the local tokenizer's output count differs from the server's usage"
        )


def request_entry(record: RequestRecord, run_start: float) -> dict[str, Any]:
    m = request_metrics(record)
    return {
        "index": record.index,
        "send_s": record.send_time - run_start,
        "ttft_ms": m.ttft_ms,
        "ttft_first_chunk_ms": m.ttft_first_chunk_ms,
        "e2e_ms": m.e2e_ms,
        "tpot_ms": m.tpot_ms,
        "prompt_tokens": record.prompt_tokens,
        "shared_prefix_tokens": record.shared_prefix_tokens,
        "output_tokens": record.output_tokens,
        "token_count_source": record.token_count_source,
        "error": record.error,
        "itl_ms": m.itl_ms,
        "conversation": record.conversation,
        "turn": record.turn,
        "language": record.language,
        "priority": record.priority,
        "x_request_id": record.x_request_id,
        "chunks": [[c.time - record.send_time, c.kind, c.num_tokens] for c in record.chunks],
    }


def language_table(records: list[RequestRecord]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for r in records:
        if r.language is None or not r.succeeded or r.language in table:
            continue
        table[r.language] = {
            "chars": r.prompt_chars,
            "tokens": r.prompt_tokens,
            "tokens_per_char": r.prompt_tokens / max(r.prompt_chars, 1),
        }
    return table


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    info = discover(config)
    tokenizer = load_tokenizer(config, info)
    spec = config.dataset
    if spec.name == "long-context" and spec.max_model_len is None:
        spec = replace(spec, max_model_len=info.max_model_len)
    # The load is part of the run's shape: a sweep's runs at different loads draw different prompts.
    salt = json.dumps(asdict(config.load), sort_keys=True)
    workload = build_workload(spec, tokenizer, num_warmup=config.warmup, salt=salt)
    runner = Runner(config, info, tokenizer)
    runner.priorities = assign_priorities(len(workload.conversations), config.priority_mix, spec.seed)
    runner.warnings += workload.notes
    if config.endpoint == "chat":
        check_input_lengths(config, workload, runner.warnings)
    duration = asyncio.run(runner.run(workload))
    measured = [r for r in runner.records if not r.is_warmup]
    count_with_server_tokenizer(config, measured)
    check_output_counts(measured, tokenizer, runner.warnings)
    result: dict[str, Any] = {"config": _config_dict(config, info)}
    result.update(aggregate(measured, duration, config.slo))
    by_priority = per_priority(measured)
    if by_priority is not None:
        result["per_priority"] = by_priority
    client_ttft = result["ttft_ms"]["mean"]
    timings = [r.server_timings for r in measured if r.succeeded and r.server_timings]
    result["server"] = server_section(
        runner.before, runner.after, client_ttft, runner.gauges, timings, result["completed"]
    )
    if runner.step_records:
        result["server"]["steps"] = {"fields": [*STEP_KEYS, *ROW_STEP_KEYS], "rows": runner.step_records}
    if runner.window is not None:
        result["server"]["window"] = runner.window
    if config.replica_metrics:
        result["replicas"] = runner.replicas.sections()
    result["server_info"] = info.as_json()
    exported = engine_config(runner.before) if runner.before is not None else None
    if exported is not None:  # the doctor reads the settings from here once the server is gone
        result["server_info"]["engine_config"] = {"server": exported[0], "labels": exported[1]}
    result["errors"] = dict(Counter(r.error for r in measured if r.error is not None))
    result["warnings"] = runner.warnings
    if spec.name == "multilingual":
        result["languages"] = language_table(measured)
    run_start = min((r.send_time for r in measured), default=0.0)
    result["requests"] = [request_entry(r, run_start) for r in measured]
    return result


def _config_dict(config: BenchConfig, info: ServerInfo) -> dict[str, Any]:
    return {
        "base_url": config.base_url,
        "model": info.model,
        "endpoint": config.endpoint,
        **{f"dataset_{k}" if k == "name" else k: v for k, v in asdict(config.dataset).items()},
        # the load's seed beside the dataset's (`seed`): one key had held whichever came last
        **{("load_seed" if k == "seed" else k): v for k, v in asdict(config.load).items() if v is not None},
        "slo": config.slo,
        "priority_mix": {str(p): share for p, share in config.priority_mix.items()},
        "warmup": config.warmup,
        "ignore_eos": config.ignore_eos,
        "temperature": config.temperature,
        # How often the run scraped /metrics: each scrape holds the server's GIL while it renders
        # (an 8 ms engine step on a 2-core VM), so a re-run (`kvflow doctor --verify`) scrapes alike.
        "metrics_interval": config.metrics_interval,
        "tokenizer": config.tokenizer or info.root,
        "replica_metrics": list(config.replica_metrics),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
