"""FSDP2's collectives through shared memory between the ranks of one host (cpu_collectives.py)
give what gloo's give, in pieces too, and leave nothing behind in /dev/shm."""

import pytest
from dist import torchrun

COLLECTIVES = """
import glob, os, sys, torch, torch.distributed as dist
from hflow.distributed.cpu_collectives import HostSharedMemory
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
before = set(glob.glob("/dev/shm/hflow-*"))
group = dist.new_group(list(range(world)))
assert HostSharedMemory.on_one_host(group)
# 48-byte slots: every tensor below goes through in many pieces, one not filling its slot
for slot_bytes in (48, 2**20):
    host = HostSharedMemory(group, slot_bytes=slot_bytes)
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 7, 1000):
            x = torch.randn(n, generator=g).to(dtype)
            want, got = torch.empty(world * n, dtype=dtype), torch.full((world * n,), float("nan"), dtype=dtype)
            dist.all_gather_into_tensor(want, x, group=group)
            host.all_gather(got, x)
            assert torch.equal(got, want), ("all_gather", slot_bytes, dtype, n)
            y = torch.randn(world * n, generator=g).to(dtype)
            for op in HostSharedMemory.OPS:
                want, got = torch.empty(n, dtype=dtype), torch.full((n,), float("nan"), dtype=dtype)
                # the oracle: every rank's input gathered, summed by hand in float64
                everyone = torch.empty(world * world * n, dtype=dtype)
                dist.all_gather_into_tensor(everyone, y, group=group)
                exact = everyone.double().view(world, world, n)[:, rank].sum(0)
                if op == dist.ReduceOp.AVG:
                    exact /= world
                host.reduce_scatter(got, y, op)
                tol = 1e-6 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol * 4)
    dist.barrier()
assert set(glob.glob("/dev/shm/hflow-*")) == before, "a shared-memory file was left behind"
sys.stdout.write(f"ok {rank}\\n")  # one write: the ranks share the pipe
# tearing down gloo groups sometimes aborts a rank at exit ("terminate called without an active
# exception", as tests/programs/reshard_generation_shards.py says): leave at once when all are done
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_collectives_equal_gloos_in_pieces_and_leave_no_file(tmp_path, world):
    run = torchrun(COLLECTIVES, nproc=world, tmp_path=tmp_path, timeout=240).check()
    assert run.output.count("ok ") == world


FSDP_USES_IT = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2Config, Qwen2ForCausalLM
from hflow.distributed import cpu_collectives
from hflow.workers.fsdp import FSDPConfig, shard_model

calls = []
for name in ("all_gather", "reduce_scatter"):
    real = getattr(cpu_collectives.HostSharedMemory, name)
    setattr(cpu_collectives.HostSharedMemory, name,
            lambda self, *a, _real=real, _name=name: (calls.append(_name), _real(self, *a))[1])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = shard_model(Qwen2ForCausalLM(config), mesh, FSDPConfig(param_dtype="float32", shard_size=2))
ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
model(input_ids=ids).logits.square().mean().backward()
assert calls.count("all_gather") >= 3 and calls.count("reduce_scatter") >= 3, calls
# the engine's tp-1 gather of the weights too, equal to DTensor's own gather over gloo
from hflow.distributed.reshard import generation_mesh, generation_weights
params, before = dict(model.named_parameters()), calls.count("all_gather")
for name, weight in generation_weights(model, generation_mesh(mesh, 1)):
    assert torch.equal(weight, params[name].full_tensor()), name
assert calls.count("all_gather") >= before + len(params), (calls.count("all_gather") - before, len(params))
sys.stdout.write(f"ok {dist.get_rank()}\\n")
# tearing down gloo groups sometimes aborts a rank at exit ("terminate called without an active
# exception", as tests/programs/reshard_generation_shards.py says): leave at once when all are done
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.dist
def test_fsdp_on_cpu_runs_its_collectives_through_shared_memory(tmp_path):
    """The 1-rank == 2-rank training test (test_fsdp.py) checks the numbers; this checks that
    they came through the shared memory (3 units: 2 layers and the root), and that the
    engine's weights are gathered through it too, equal to DTensor's own gather."""
    run = torchrun(FSDP_USES_IT, nproc=2, tmp_path=tmp_path, timeout=240).check()
    assert run.output.count("ok ") == 2


NO_ROOM = """
import os, sys, torch, torch.distributed as dist
from hflow.distributed import cpu_collectives
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 1:   # as a /dev/shm too small for the slots (Docker's default 64 MB) on one rank
    cpu_collectives._reserve = lambda path, nbytes: False
group = dist.new_group([0, 1])
assert cpu_collectives.host_shared_memory(group) is None    # on both ranks: gloo for all
x = torch.full((4,), float(rank + 1))
dist.all_reduce(x, group=group)
assert x.tolist() == [3.0] * 4
sys.stdout.write(f"fell back {rank}\\\\n")
dist.barrier()
sys.stdout.flush()
os._exit(0)   # as above
"""


@pytest.mark.dist
def test_a_rank_without_room_in_dev_shm_sends_the_whole_group_to_gloo(tmp_path):
    run = torchrun(NO_ROOM, nproc=2, tmp_path=tmp_path, timeout=120).check()
    assert run.output.count("fell back ") == 2
    assert "/dev/shm could not hold 64 MiB for each of 1 of the 2 ranks" in run.output
