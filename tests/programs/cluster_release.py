"""close() frees an Actor group, later calls raise; run by test_cluster.py::test_close_frees_the_workers_memory_and_later_calls_raise."""
import sys, hflow
from hflow.runtime.dispatch import dispatch
from hflow.workers import Actor, ActorConfig, RolloutConfig
from test_fsdp import random_rollouts


class Memory:
    def __init__(self, mesh):
        pass

    @dispatch("all")
    def resident_bytes(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096


def pg_loss(logp, mb, entropy=None):
    return -(logp * mb["advantages"] * mb["response_mask"]).sum() / mb["response_mask"].sum(), {}


def used_actor(cluster, path):
    actor = cluster.spawn(Actor, ActorConfig(model_path=path))
    actor.generate(hflow.Batch({"prompt_ids": [[5, 6, 7]] * 4}), RolloutConfig(n=2, max_tokens=4))
    actor.update(hflow.Batch(random_rollouts(4, 2, 1000, seed=0)), pg_loss)
    return actor


def main(cluster, path):
    memory = cluster.spawn(Memory)
    used_actor(cluster, path).close()   # the first one also loads code and warms up allocators
    before = memory.resident_bytes()
    actor = used_actor(cluster, path)
    used = memory.resident_bytes()
    actor.close()
    after = memory.resident_bytes()
    for rank, (b, u, a) in enumerate(zip(before, used, after)):
        print(f"rank {rank}: {b / 2**20:.0f} MiB -> {u / 2**20:.0f} MiB in use -> {a / 2**20:.0f} MiB after close")
        assert u - b > 40 * 2**20, "the actor should hold its shards, optimizer state and engine"
        assert a - b < 0.2 * (u - b), "close() should give back what the actor held"
    try:
        actor.log_probs(hflow.Batch(random_rollouts(2, 1, 1000, seed=1)))
    except RuntimeError as e:
        assert "released" in str(e), e
        return "ALL OK"
    raise AssertionError("a call on a released group must raise")

print(hflow.launch(main, sys.argv[1]))
