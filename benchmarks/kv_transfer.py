"""The prefill-to-decode KV transfer alone (kvflow/kv_transfer/): bytes per second of a fetch through
a shared-memory segment (prefill and decode on one machine), over loopback TCP (ZeroMQ frames, as
between machines) and, where it is installed, as a NIXL READ (UCX), against a plain memcpy of the
same bytes, alternated in one run.

    python benchmarks/kv_transfer.py [--tokens 1536] [--repeats 5]

Block payloads of the Qwen2.5-0.5B shape in bf16 (24 layers x K and V x 2 KV heads x 64 dims x 2
bytes = 12 KiB per token, 16 tokens a block), exported, served and fetched as the engines do: the
fetch time is what a decode instance adds to TTFT before its first step. The doctor's
disaggregation what-if (kvflow/doctor/disaggregation.py) uses this rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvflow.kv_transfer.client import KVTransferClient  # noqa: E402
from kvflow.kv_transfer.exports import KVExports  # noqa: E402
from kvflow.kv_transfer.nixl_transport import nixl_available  # noqa: E402
from kvflow.kv_transfer.params import RemotePrefill  # noqa: E402
from kvflow.kv_transfer.server import KVTransferServer  # noqa: E402

BLOCK = 16
BYTES_PER_TOKEN = 24 * 2 * 2 * 64 * 2


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-nixl", action="store_true", help="leave NIXL out even where it is installed")
    args = parser.parse_args()
    num_blocks = args.tokens // BLOCK
    payload = bytes(BLOCK * BYTES_PER_TOKEN)
    hashes = [i.to_bytes(32, "big") for i in range(num_blocks)]
    exports = KVExports(ttl_s=60, capacity_bytes=1 << 34)
    server = KVTransferServer(exports, "fp", "127.0.0.1", 0)
    clients = {
        "shared memory": KVTransferClient(timeout_s=30),
        "TCP": KVTransferClient(30, backend="tcp"),
    }
    if nixl_available() and not args.no_nixl:  # pip install nixl-cu12
        clients["NIXL (UCX)"] = KVTransferClient(30, backend="nixl")
    total = num_blocks * len(payload)
    fetch_s: dict[str, list[float]] = {name: [] for name in clients}
    copy_s = []
    for r in range(args.repeats):
        for name, client in clients.items():
            exports.put(f"t{r}{name}", hashes, [payload] * num_blocks)
            remote = RemotePrefill("127.0.0.1", server.port, f"t{r}{name}", tuple(hashes), "fp")
            start = time.perf_counter()
            read = client.fetch_async(remote, 0, num_blocks).result()
            fetch_s[name].append(time.perf_counter() - start)
            assert len(read.payloads) == num_blocks
        start = time.perf_counter()
        copies = [bytearray(p) for p in read.payloads]  # what landing the bytes costs at least
        copy_s.append(time.perf_counter() - start)
        del copies
    server.close()
    for client in clients.values():
        client.close()
    c = statistics.median(copy_s)
    print(f"{args.tokens} tokens = {num_blocks} blocks = {total / 2**20:.1f} MiB, median of {args.repeats}")
    for name, times in fetch_s.items():
        f = statistics.median(times)
        print(f"fetch, {name:<13}: {1e3 * f:6.1f} ms ({total / f / 1e9:.2f} GB/s), {f / c:.1f}x a memcpy")
    print(f"memcpy of the same bytes: {1e3 * c:.1f} ms ({total / c / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
