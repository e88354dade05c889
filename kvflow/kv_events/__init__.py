"""KV cache events: what the prefix cache stores and evicts, published as vLLM publishes them.

A router that sees each replica's cached blocks routes a request to the replica that already holds
its prefix (vllm-router's `kv_aware` policy, Dynamo's KV router, llm-d's scheduler). kvflow speaks
vLLM's wire format (`--kv-events-config`, msgpack over ZeroMQ), so those routers need nothing new:
    events.py     the wire structs (BlockStored / BlockRemoved / AllBlocksCleared in a batch)
    event_log.py  the block pool's record of what entered and left the prefix-cache index
    publisher.py  the ZeroMQ PUB socket (with a replay socket for subscribers that missed batches)
    (`--kv-events-config`, vLLM's JSON keys, is KVEventsConfig in kvflow/config.py)
"""
