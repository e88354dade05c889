"""Engine and server configuration: frozen dataclasses split by concern, validated with clear errors.

Each component takes only its own config. `EngineConfig.from_kwargs` maps the flat keyword
arguments users pass to `LLM(...)` (and the CLI flags generated from the same fields by
kvflow/arg_utils.py) onto them. A field's metadata holds its flag's help text (and, rarely, a flag
name other than the field's). Pure Python: no torch import, so the scheduler and its tests, and the
CLI's parser, stay torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from kvflow.errors import InvalidRequestError
from kvflow.reasoning import ReasoningParserName

DType = Literal["auto", "float32", "bfloat16", "float16"]
QuantizedKVDType = Literal["fp8_e4m3", "int8", "int4"]
KVCacheDType = Literal["auto", "bfloat16", "float16", QuantizedKVDType]
KVRole = Literal["both", "prefill", "decode"]
KVTransferBackend = Literal["auto", "tcp", "nixl"]

# Default KV pool budget when neither `kv_cache_memory_bytes` nor `num_kv_blocks` is given:
# vLLM's CPU backend defaults to 4 GiB (VLLM_CPU_KVCACHE_SPACE); the pool is also capped at what
# `max_num_seqs` requests of `max_model_len` tokens could ever use, so tiny models stay tiny.
DEFAULT_KV_CACHE_MEMORY_BYTES = 4 * 1024**3


class ConfigError(InvalidRequestError):
    """An engine argument is out of range or inconsistent with another one."""


def _check_choice(name: str, value: object, choices: Any) -> None:
    """`value` must be one of the Literal type `choices` (a config built in Python skips argparse)."""
    if value not in typing.get_args(choices):
        raise ConfigError(f"{name} must be {'|'.join(typing.get_args(choices))}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(
        default="",
        metadata={"help": "Hugging Face checkpoint directory, or a GGUF file (llama.cpp's format)"},
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "tokenizer directory (tokenizer.json) or GGUF file; default: the model's own (a GGUF "
            "file's from its metadata)"
        },
    )
    dtype: DType = field(
        default="auto",
        metadata={
            "help": "weight/activation dtype; auto = the checkpoint's (float16 becomes bfloat16 on CPU)"
        },
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length (prompt + output); default: the model's"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the engine's random generator"})
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "run every step through the Python layers (the reference path); otherwise decode-only "
            "steps of bf16 models run all layers in one native call, bit-identical (vLLM's flag name)"
        },
    )
    batch_invariant: bool = field(
        default=False,
        metadata={
            "help": "a request's tokens depend only on its prompt, parameters and seed, never on what else "
            "is batched with it: every linear runs the row-invariant GEMVs and every query row attends "
            "alone (vLLM's term; bf16 models with the native kernels; slower prefill, see "
            "benchmarks/NOTES.md)"
        },
    )

    reasoning_parser: ReasoningParserName | None = field(
        default=None,
        metadata={
            "help": "split a reasoning model's thinking into reasoning_content (vLLM's flag): "
            "deepseek_r1 (DeepSeek-R1, V3.1+), qwen3 (Qwen3, QwQ): <think>...</think>; openai_gptoss "
            "(gpt-oss): harmony's analysis channel; structured outputs and tool calls are then constrained "
            "after the reasoning (kvflow/reasoning/)"
        },
    )

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, DType)
        if self.reasoning_parser is not None:
            _check_choice("reasoning_parser", self.reasoning_parser, ReasoningParserName)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")


KV_EVENT_PUBLISHERS = ("null", "zmq")

# `--kv-events-config`: vLLM's JSON, key for key (`vllm/config/kv_events.py` KVEventsConfig), so a
# deployment's flags move between vLLM and kvflow unchanged (kvflow/kv_events/).


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # "zmq" publishes; "null" (vLLM's default) records nothing.
    publisher: str = "null"
    # The PUB socket. An address with "*" (or ipc://, inproc://) is bound, any other is connected
    # to: the stable side binds (vLLM's rule).
    endpoint: str = "tcp://*:5557"
    # An optional ROUTER socket: a subscriber that missed batches sends the first sequence number it
    # lacks (8 bytes, big-endian) and gets every buffered batch from there, then the end marker.
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages queued per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""  # the first frame of every message; subscribers filter on its prefix

    def __post_init__(self) -> None:
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ConfigError(
                f"kv_events_config: publisher must be one of {KV_EVENT_PUBLISHERS}, got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"kv_events_config: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(self, name)
            if address is not None and not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(
                    f"kv_events_config: {name} must be a tcp://, ipc:// or inproc:// address, got {address!r}"
                )

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            values: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"kv_events_config is not valid JSON ({exc}): {text!r}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"kv_events_config must be a JSON object, got {text!r}")
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"kv_events_config: unknown keys {unknown}; known: {sorted(known)}")
        expected = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "topic": str}
        for key, value in values.items():
            want = expected.get(key, int if key in ("buffer_steps", "hwm", "max_queue_size") else str)
            if key == "replay_endpoint" and value is None:
                continue
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                kind = {bool: "true or false", int: "an integer", str: "a string"}[want]
                raise ConfigError(f"kv_events_config: {key} must be {kind}, got {value!r}")
        return cls(**values)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV of identical prefixes"})
    kv_cache_memory_bytes: int | None = field(
        default=None, metadata={"help": "bytes for the KV pool (default 4 GiB, capped at what can be used)"}
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "KV pool size in blocks; overrides kv_cache_memory_bytes"}
    )
    kv_cache_dtype: KVCacheDType = field(
        default="auto",
        metadata={
            "help": "KV storage: auto (model dtype), bfloat16, float16, or quantized per token and head: "
            "fp8_e4m3, int8, int4 (more blocks for the same memory)"
        },
    )
    kv_offload_path: str | None = field(
        default=None,
        metadata={
            "help": "directory of a KV offload tier on disk: full prefix-cache blocks evicted from the pool "
            "are written there and read back on a later prefix miss instead of recomputing the prefill; "
            "survives restarts (kvflow/kv_offload/)"
        },
    )
    kv_offload_size: float = field(
        default=16.0,
        metadata={"help": "GiB the KV offload tier may hold on disk (least recently used go first)"},
    )
    kv_events_config: str | None = field(
        default=None,
        metadata={
            "help": "publish KV cache events (blocks stored / removed) for a KV-aware router, as vLLM does: "
            'its JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
            '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (kvflow/kv_events/)'
        },
    )
    kv_role: KVRole = field(
        default="both",
        metadata={
            "help": "prefill/decode disaggregation behind vllm-router --vllm-pd-disaggregation: 'prefill' "
            "keeps the KV of requests marked do_remote_decode for a decode instance to fetch; 'decode' "
            "fetches it for requests marked do_remote_prefill; 'both' (colocated) does neither "
            "(kvflow/kv_transfer/)"
        },
    )
    kv_transfer_host: str = field(
        default="127.0.0.1",
        metadata={"help": "prefill role: the address decode instances reach its KV transfer socket at"},
    )
    kv_transfer_port: int = field(
        default=0, metadata={"help": "prefill role: the KV transfer socket's TCP port (0: any free one)"}
    )
    kv_transfer_backend: KVTransferBackend = field(
        default="auto",
        metadata={
            "help": "decode role: how a prompt's KV comes from its prefill instance: 'auto' (a shared-memory "
            "segment when both run on this machine, else ZeroMQ frames over TCP), 'tcp' (always the frames), "
            "'nixl' (a NIXL READ of the prefill's registered memory; pip install nixl-cu12 on both)"
        },
    )
    kv_transfer_timeout: float = field(
        default=30.0,
        metadata={
            "help": "decode role: seconds to wait for a prompt's KV (and prefill role: twice this, to keep "
            "it for the fetch) before the request fails"
        },
    )
    linear_state_checkpoint_interval: int | None = field(
        default=None,
        metadata={
            "help": "linear-attention models (Qwen3-Next): tokens between prefix-cache checkpoints of the "
            "recurrent state, a multiple of block_size; default: the shortest span whose full-attention KV "
            "outweighs one checkpoint (docs/doctor.md, 'Cache kinds')"
        },
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_offload_size <= 0:
            raise ConfigError(f"kv_offload_size must be > 0 GiB, got {self.kv_offload_size}")
        if self.kv_offload_path is not None and not self.enable_prefix_caching:
            raise ConfigError("kv_offload_path needs prefix caching (the tier keys blocks by prefix hashes)")
        _check_choice("kv_role", self.kv_role, KVRole)
        if self.kv_role != "both" and not self.enable_prefix_caching:
            raise ConfigError("kv_role prefill/decode needs prefix caching (KV moves by prefix block hashes)")
        if not 0 <= self.kv_transfer_port < 2**16:
            raise ConfigError(f"kv_transfer_port must be a TCP port (0: any), got {self.kv_transfer_port}")
        if self.kv_transfer_timeout <= 0:
            raise ConfigError(f"kv_transfer_timeout must be > 0 s, got {self.kv_transfer_timeout}")
        events = None if self.kv_events_config is None else KVEventsConfig.from_json(self.kv_events_config)
        if events is not None and events.publishes and not self.enable_prefix_caching:
            raise ConfigError("kv_events_config needs prefix caching (events name prefix-cache blocks)")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KVCacheDType)
        interval = self.linear_state_checkpoint_interval
        if interval is not None and (interval < self.block_size or interval % self.block_size):
            raise ConfigError(
                f"linear_state_checkpoint_interval must be a positive multiple of block_size "
                f"({self.block_size}), got {interval}"
            )


SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata={"help": "maximum requests running at once"})
    max_num_batched_tokens: int = field(
        default=512,
        metadata={
            "help": "token budget per step (prefill chunks + decode tokens); bounds the ITL stall a "
            "prefill chunk causes to the decodes sharing its step"
        },
    )

    scheduling_policy: SchedulingPolicy = field(
        default="fcfs",
        metadata={
            "help": "fcfs: arrival order; priority: by the request's priority (lower value first, vLLM's "
            "convention), arrival order within one, and KV pressure preempts the lowest priority first"
        },
    )

    def __post_init__(self) -> None:
        _check_choice("scheduling_policy", self.scheduling_policy, SchedulingPolicy)
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


QuantMethod = Literal["none", "int8", "int4"]
# How `kvflow quant-eval` scores positions (kvflow/quality/teacher_forcing.py).
ScoringPath = Literal["prefill", "decode"]
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantConfig:
    quantization: QuantMethod = field(
        default="none",
        metadata={
            "help": "weight-only quantization at load: int8 (per output channel, symmetric) or int4 "
            "(group-wise, asymmetric)"
        },
    )
    quantization_group_size: int = field(default=128, metadata={"help": "int4 group size: 32, 64 or 128"})
    quantize_lm_head: bool = field(
        default=False, metadata={"help": "quantize the LM head too (it stays in the model dtype otherwise)"}
    )

    def __post_init__(self) -> None:
        _check_choice("quantization", self.quantization, QuantMethod)
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            size = self.quantization_group_size
            raise ConfigError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {size}")

    @property
    def enabled(self) -> bool:
        return self.quantization != "none"


SpeculativeMethod = Literal["none", "ngram", "draft"]
ToolCallParserName = Literal["auto", "hermes", "llama3_json", "openai"]


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_method: SpeculativeMethod = field(
        default="none",
        metadata={
            "help": "speculative decoding: ngram (prompt lookup) or draft (a smaller model, --draft-model)"
        },
    )
    draft_model: str | None = field(
        default=None,
        metadata={"help": "draft checkpoint directory or GGUF file (same vocabulary as the model)"},
    )
    num_speculative_tokens: int = field(default=3, metadata={"help": "draft tokens verified per step"})
    prompt_lookup_min: int = field(default=1, metadata={"help": "ngram: shortest suffix n-gram to match"})
    prompt_lookup_max: int = field(default=4, metadata={"help": "ngram: longest suffix n-gram to match"})
    speculative_auto_disable: bool = field(
        default=False,
        metadata={"help": "skip speculation in steps where the measured speedup estimate is below 1"},
    )

    def __post_init__(self) -> None:
        _check_choice("speculative_method", self.speculative_method, SpeculativeMethod)
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ConfigError("--draft-model is needed by, and only by, --speculative-method draft")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}"
            )

    @property
    def enabled(self) -> bool:
        return self.speculative_method != "none"


AllReduceBackend = Literal["auto", "shm", "gloo"]


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (kvflow/parallel/): one model sharded over N processes, vLLM's way."""

    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks the model is sharded over (Megatron-style: heads, MLP columns and vocab split); "
            "N > 1 starts N - 1 worker processes beside this one, or joins torchrun's (WORLD_SIZE, RANK)"
        },
    )
    cpu_threads_per_rank: int | None = field(
        default=None,
        metadata={
            "help": "CPU cores each rank pins and runs torch threads on; unset: this machine's cores split "
            "evenly between its ranks"
        },
    )

    all_reduce_backend: AllReduceBackend = field(
        default="auto",
        metadata={
            "help": "tensor parallel collectives: shm (shared memory, ranks on one machine), gloo "
            "(torch.distributed over TCP, any machines), auto: shm when every rank is on this machine"
        },
    )

    def __post_init__(self) -> None:
        _check_choice("all_reduce_backend", self.all_reduce_backend, AllReduceBackend)
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cpu_threads_per_rank is not None and self.cpu_threads_per_rank < 1:
            raise ConfigError(f"cpu_threads_per_rank must be >= 1, got {self.cpu_threads_per_rank}")


_SECTIONS: tuple[tuple[str, type], ...] = (
    ("model_config", ModelConfig),
    ("cache_config", CacheConfig),
    ("scheduler_config", SchedulerConfig),
    ("quant_config", QuantConfig),
    ("speculative_config", SpeculativeConfig),
    ("parallel_config", ParallelConfig),
)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    quant_config: QuantConfig = field(default_factory=QuantConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Split flat keyword arguments (`LLM(model=..., block_size=...)`) into the sections."""
        sections: dict[str, dict[str, Any]] = {name: {} for name, _ in _SECTIONS}
        owner = {f.name: name for name, klass in _SECTIONS for f in dataclasses.fields(klass)}
        for key, value in kwargs.items():
            if key not in owner:
                raise ConfigError(f"unknown engine argument {key!r}; known: {', '.join(sorted(owner))}")
            sections[owner[key]][key] = value
        built = {name: klass(**sections[name]) for name, klass in _SECTIONS}
        return cls(**built)

    @staticmethod
    def section_types() -> tuple[type, ...]:
        """The sections' dataclasses: every engine argument is a field of one (the CLI's flags too)."""
        return tuple(klass for _, klass in _SECTIONS)


# The environment variable `kvflow serve` reads the API key from when --api-key is not given.
API_KEY_ENV = "KVFLOW_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    """`kvflow serve`'s own settings (the engine's are EngineConfig's). Plain like the engine's
    sections, so the CLI builds its flags without importing the server (uvicorn, torch)."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    served_model_name: str | None = field(
        default=None,
        metadata={"help": "the model name clients send; unset: the MODEL path as given (vLLM's default)"},
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "serve chat with this Jinja template instead of the tokenizer's (vLLM's flag): a file "
            "path, or the template text itself"
        },
    )
    api_key: str | None = field(
        default=None,
        metadata={"help": f"require 'Authorization: Bearer KEY'; unset: ${API_KEY_ENV} if set, else none"},
    )
    max_waiting: int | None = field(
        default=None,
        metadata={
            "help": "requests queued while all max_num_seqs running slots are busy; beyond: HTTP 429 "
            "(a request needing more than max_num_seqs + this: 400); unset: no limit (vLLM's behaviour)"
        },
    )
    shutdown_grace_s: float = field(
        default=5.0,
        metadata={
            "flag": "--shutdown-grace-seconds",  # the flag's name since the first release
            "help": "on SIGINT/SIGTERM, seconds in-flight requests get to finish (new ones get 503); "
            "then each is ended with finish_reason abort",
        },
    )
    # 8 MiB: a full 128k-token context is about 0.5 MB of text or 1 MB of token ids; the parsed body
    # costs tens of times its size in memory, so this is also a memory bound.
    max_request_body_bytes: int = field(
        default=8 * 1024**2, metadata={"help": "larger request bodies get HTTP 413"}
    )
    max_choices_per_request: int = field(
        default=128,
        metadata={
            "help": "prompts x n one request may ask for (each is an engine request); beyond: HTTP 400"
        },
    )
    client_timeout_s: float = field(
        default=30.0,
        metadata={
            "flag": "--client-timeout-seconds",
            "help": "a client must send its request's headers, and then its body, within this; "
            "otherwise the connection is closed (headers) or answered 408 (body)",
        },
    )
    max_connections: int = field(
        default=1024,
        metadata={"help": "open connections (or running requests) beyond this are answered 503"},
    )
    log_level: str = field(
        default="info", metadata={"help": "logging level (the server's and uvicorn's for serve)"}
    )
    quality_probe_rate: float = field(
        default=0.0,
        metadata={
            "help": "score this share of finished requests against unquantized weights (Prometheus gauges)"
        },
    )
    tool_call_parser: ToolCallParserName = field(
        default="auto",
        metadata={
            "help": "how tool calls are read from the model's text with tool_choice=auto (vLLM's flag): "
            "hermes (<tool_call>{json}</tool_call>, Qwen2.5/Qwen3), llama3_json (Llama-3.1's JSON), "
            "openai (gpt-oss's harmony calls; with --reasoning-parser openai_gptoss); "
            "auto: detected from the chat template"
        },
    )
    dashboard: bool = field(
        default=True,
        metadata={"help": "serve the live dashboard at /dashboard (same API key; docs/dashboard.md)"},
    )
    dashboard_window_s: float = field(
        default=300.0,
        metadata={
            "flag": "--dashboard-window-seconds",
            "help": "the dashboard's histograms, usage history and doctor view cover this many last seconds",
        },
    )

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ConfigError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        for name in ("max_request_body_bytes", "max_choices_per_request", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.client_timeout_s > 0:
            raise ConfigError(f"client_timeout_s must be > 0, got {self.client_timeout_s}")
        if not self.dashboard_window_s > 0:
            raise ConfigError(f"dashboard_window_s must be > 0, got {self.dashboard_window_s}")
