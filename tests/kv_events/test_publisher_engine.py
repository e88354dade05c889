"""KV events from a running engine over ZeroMQ, read as a router reads them: a SUB socket on the PUB
endpoint and a replay request on the ROUTER endpoint. The stream, replayed, reconstructs exactly the
engine's cached blocks while a pool too small for the prompts evicts and re-caches."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import zmq
from fixtures.kv_event_replica import Replica

from kvflow import LLM, SamplingParams
from kvflow.config import ConfigError
from kvflow.kv_events.events import decode_batch, external_block_hash
from kvflow.kv_events.publisher import END_OF_REPLAY, SEQ_BYTES

BLOCK = 4
RECEIVE_TIMEOUT_MS = 5000  # generous: the publisher thread sends within milliseconds


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("llama", dtype=torch.float32)


def events_config(tmp_path: Path, **extra: object) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{tmp_path}/kv-events",
            "replay_endpoint": f"ipc://{tmp_path}/kv-replay",
            "topic": "kv@test",
            **extra,
        }
    )


def receive_all(sub: zmq.Socket[bytes]) -> list[tuple[int, bytes]]:
    """(seq, payload) of every message until the socket stays quiet."""
    messages = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@test"
        messages.append((int.from_bytes(seq, "big"), payload))
    return messages


def test_subscriber_and_replay_reconstruct_the_engine_cache(checkpoint: Path, tmp_path: Path) -> None:
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=24,
        max_model_len=96,
        kv_events_config=events_config(tmp_path),
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"ipc://{tmp_path}/kv-events")
    # A PUB socket drops messages until a subscription arrives (ZeroMQ's slow joiner): a step with
    # nothing cached publishes nothing, so prompts start only once the subscriber is connected.
    sub.poll(200)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    system = [rng.randrange(3, vocab) for _ in range(12)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 30))] for _ in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))

    messages = receive_all(sub)
    assert [seq for seq, _ in messages] == list(range(len(messages))), "sequence numbers skip"
    live = Replica()
    for _, payload in messages:
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0
        live.apply(batch.events)
    pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
    index = {external_block_hash(key) for key in pool.cached_block_hash_to_block}
    assert live.cached == index and index
    assert len(live.tokens) > len(index), "the small pool never evicted"
    # The shared system prompt's first three blocks are stored once and stay cached (its blocks
    # are the last of each request to be freed, so the most recently used).
    first = next(decode_batch(p).events[0] for _, p in messages)
    assert first.token_ids[: 3 * BLOCK] == system[: 3 * BLOCK]

    # A late subscriber asks the replay socket for everything from seq 0 and gets the same batches.
    req = ctx.socket(zmq.DEALER)
    req.connect(f"ipc://{tmp_path}/kv-replay")
    req.send_multipart((b"", (0).to_bytes(SEQ_BYTES, "big")))
    replayed = []
    while True:
        assert req.poll(RECEIVE_TIMEOUT_MS), "the replay never ended"
        _, seq, payload = req.recv_multipart()
        if seq == END_OF_REPLAY:
            break
        replayed.append((int.from_bytes(seq, "big"), payload))
    assert replayed == messages
    publisher = llm.llm_engine.kv_event_publisher
    assert (
        publisher is not None and publisher.stats.replays_served == 1 and publisher.stats.batches_dropped == 0
    )
    llm.llm_engine.close()
    ctx.destroy(linger=0)


def test_bad_config_and_busy_endpoint_are_clear_errors(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="publisher must be one of"):
        LLM(str(checkpoint), kv_events_config='{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with pytest.raises(ConfigError, match="needs prefix caching"):
        LLM(str(checkpoint), enable_prefix_caching=False, kv_events_config=events_config(tmp_path))
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    busy = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})
    with pytest.raises(ConfigError, match="cannot open"):
        LLM(str(checkpoint), dtype="float32", num_kv_blocks=16, kv_events_config=busy)
    ctx.destroy(linger=0)
