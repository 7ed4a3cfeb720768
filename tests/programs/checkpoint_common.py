"""Set-up shared by test_checkpoint.py's FSDP2 programs (importing it joins the gloo group): model, train step, checks."""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2ForCausalLM

from checkpoint_fake_group import resume_on_ranks, save_on_ranks  # noqa: F401  (for the programs)
from hflow import checkpoint as ck
from hflow.default.model import build_config

torch.set_num_threads(1)
dist.init_process_group("gloo")
RANK = dist.get_rank()
MESH = init_device_mesh("cpu", (dist.get_world_size(),))
ROOT = sys.argv[1]

def build(seed, mesh=MESH):
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(build_config("tiny"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched

def train_step(model, opt, sched):
    x = torch.randint(3, 500, (4, 12))     # same RNG stream on both ranks: same batch, like DP
    loss = model(x, labels=x).loss
    opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    return loss.item()

def snapshot(model, opt):
    params = [p.full_tensor().clone() for p in model.parameters()]
    moments = [opt.state[p][k].full_tensor().clone() for p in model.parameters()
               for k in ("exp_avg", "exp_avg_sq")]
    steps = [float(opt.state[p]["step"]) for p in model.parameters()]
    return params, moments, steps

def assert_same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, list):
            assert_same(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=0)

def state(model, opt, sched):
    return {"actor": ck.ModelState(model, opt, sched), "rng": ck.RNGState()}
