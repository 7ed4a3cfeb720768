"""Train -> generate resharding: exact shards, bytes received, bytes allocated."""
import os

import pytest
from dist import PROGRAMS, torchrun
from test_fsdp import TESTS_ENV, tiny_model_dir

from hflow.distributed.byte_counters import AllocatedBytes
from hflow.distributed.reshard import generation_rank_grid, tensor_parallel_dim



def test_allocated_bytes_follows_storages():
    """The oracle of the memory test, checked by hand: new storages count until freed, views
    and tensors made before the block do not."""
    import torch

    before = torch.ones(1000)
    with AllocatedBytes() as mem:
        a = before * 2                 # +4000
        view = a[10:]                  # a view: +0
        b = torch.empty(500)           # +2000 -> 6000
        del a                          # the view keeps a's storage
        c = before + 1                 # +4000 -> 10000
        del view, b, c                 # -> 0
        d = torch.zeros(250)           # +1000
    assert (mem.peak, mem.live) == (10000, 1000)
    del d
    assert mem.live == 0


def test_generation_shard_contains_training_shard():
    """The grid claim: with tp groups strided, the rows rank i trains on (flat chunk i of N)
    lie inside the rows it generates with (chunk t of tp, t = its tp index)."""
    for world, tp in [(2, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4)]:
        grid = generation_rank_grid(list(range(world)), tp)
        rows = 64
        for t, group in enumerate(grid):
            for j, rank in enumerate(group):
                train = set(range(rank * rows // world, (rank + 1) * rows // world))
                gen = set(range(t * rows // tp, (t + 1) * rows // tp))
                assert train <= gen, (world, tp, rank)
        tp_group_of_rank0 = [group[0] for group in grid]
        assert tp_group_of_rank0 == list(range(0, world, world // tp))  # strided
    with pytest.raises(ValueError, match="tp-size 3"):
        generation_rank_grid([0, 1, 2, 3], 3)


def test_tensor_parallel_dims():
    assert tensor_parallel_dim("model.layers.0.self_attn.q_proj.weight") == 0
    assert tensor_parallel_dim("model.layers.0.self_attn.k_proj.bias") == 0
    assert tensor_parallel_dim("model.layers.3.mlp.down_proj.weight") == 1
    assert tensor_parallel_dim("model.layers.3.self_attn.o_proj.weight") == 1
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert tensor_parallel_dim(name) is None


RESHARD = os.path.join(PROGRAMS, "reshard_generation_shards.py")


@pytest.mark.dist
@pytest.mark.parametrize("world,tps,row_on_dim1,shard", [(2, "1,2", 1, 2), (2, "1,2", 0, 2), (4, "2,4", 1, 4),
                                                         (4, "1,2", 1, 2), (2, "1,2", 1, 1)])
def test_generation_shards_after_an_update(tmp_path, world, tps, row_on_dim1, shard):
    """Sharded on every rank (the GPU default), HSDP (shard groups of 2 of 4 ranks) and
    replicated (shard 1, the CPU default at these sizes)."""
    path = tiny_model_dir(tmp_path / "model", hidden=128, layers=3)
    run = torchrun(RESHARD, nproc=world, args=[path, tps, row_on_dim1, shard], tmp_path=tmp_path,
                   timeout=300, env=TESTS_ENV).check()
    assert run.output.count("peak") == world * len(tps.split(","))
