"""Prefill/decode disaggregation: a prefill instance computes a prompt's KV and hands it to a decode
instance, behind vllm-router's `--vllm-pd-disaggregation` (its NIXL contract: `kv_transfer_params` on
the request and on the prefill's response; kvflow fills the fields with its own transfer's).

    params.py    the `kv_transfer_params` a request carries and a prefill answers with
    exports.py   prefill side: finished prompts' block bytes, kept until a decode fetches them
    server.py    prefill side: the ZeroMQ socket that serves them
    client.py    decode side: fetching them off the engine step (Future[TierRead], like a tier read)
    imports.py   decode side: the scheduler's view of requests whose KV is in flight
"""
