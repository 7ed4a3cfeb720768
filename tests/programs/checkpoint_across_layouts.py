"""Saved with the weights replicated on each rank (HSDP, shard groups of 1), loaded sharded over
both ranks, and back; run by test_checkpoint.py::test_checkpoint_loads_across_sharding_layouts."""
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# importing checkpoint_common joins the gloo process group
from checkpoint_common import (MESH, RANK, ROOT, assert_same, build, resume_on_ranks, save_on_ranks, snapshot, state,
                               train_step)

REPLICATED = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
layouts = {"replicated": REPLICATED, "sharded": MESH}
for step, (saved_as, loaded_as) in enumerate([("replicated", "sharded"), ("sharded", "replicated")], start=1):
    model, opt, sched = build(0, layouts[saved_as])
    for _ in range(2):
        train_step(model, opt, sched)
    embed = model.model.embed_tokens.weight   # replicated: every rank holds all of it; sharded: half
    assert embed.to_local().shape[0] == embed.shape[0] // (1 if saved_as == "replicated" else dist.get_world_size())
    save_on_ranks(ROOT, step, state(model, opt, sched))
    saved = snapshot(model, opt)
    other, other_opt, other_sched = build(1, layouts[loaded_as])   # other weights, no Adam state yet
    assert resume_on_ranks(ROOT, state(other, other_opt, other_sched))["step"] == step
    assert_same(snapshot(other, other_opt), saved)
    assert other_sched.last_epoch == 2
    print(f"rank {RANK} {saved_as} -> {loaded_as} ok", flush=True)
dist.destroy_process_group()
