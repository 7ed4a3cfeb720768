"""hflow.distributed: meshes, collectives and moving weights between ranks.

`parallel` (this rank's device, the meshes workers build, giving freed memory back),
`cpu_collectives` (FSDP2's collectives on CPU: reused buffers, shared memory between the ranks
of one host), `reshard` (training shards -> generation shards), `weight_sync` (the actor's
weights to a rollout group on other ranks), `byte_counters` (the bytes collectives receive and
ops allocate, peak memory: for benchmarks and tests).
"""
