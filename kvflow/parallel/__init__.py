"""Tensor parallelism on torch.distributed, vLLM's way (docs/ARCHITECTURE.md, README "Tensor parallel").

One model sharded Megatron-style over N processes ("ranks"): q/k/v and gate/up column-parallel,
o_proj and down_proj row-parallel (one all-reduce each per layer), embedding and LM head split by
vocabulary. Rank 0 is the engine process (scheduler, sampler, its own shard); ranks 1..N-1 are
worker processes that receive each step's SchedulerOutput in one message and run the same forward.

    sharding.py        which slice of each checkpoint tensor a rank holds; the per-rank shapes
    sharded_reader.py  reads only those slices from the safetensors files (safe_open get_slice)
    prequantized_slices.py  the same slices of GPTQ / AWQ / compressed-tensors packed tensors
    layers.py          row-parallel linear, vocab-parallel embedding, parallel LM head
    model_loader.py    checkpoint -> this rank's shard of the llama-family model
    communicator.py    all-reduce / gather: gloo (any machines), shared memory (ranks on one host)
    shm_communicator.py  the shared-memory all-reduce
    state.py           ParallelContext (rank, world size, communicator), passed, never global
    step_channel.py    the per-step message rank 0 -> workers
    worker.py          a worker rank's loop
    executor.py        start / join ranks, the driver's model runner, worker-death detection
"""
