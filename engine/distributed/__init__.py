"""Tensor parallelism on CPU: the model sharded over `tensor_parallel_size` processes (gloo).

`sharding`: which heads, rows and vocabulary slice each rank holds (no torch.distributed).
`group`: rank 0's side (starts the workers, sends each step, detects a dead worker).
`worker`: the entry point of ranks 1..N-1 (`python -m triollm.engine.distributed.worker`).
"""
