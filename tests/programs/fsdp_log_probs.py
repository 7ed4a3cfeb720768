"""Actor and Reference log-probs equal a transformers forward; run by test_fsdp.py::test_log_probs_equal_transformers_forward."""
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM
from hflow.workers import Actor, ActorConfig, Reference
from hflow.layout import position_ids
from test_fsdp import random_rollouts
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
path = sys.argv[1]
batch = random_rollouts(4, 2, 101, seed=1)
local = {k: v.chunk(world)[rank] for k, v in batch.items()}
cfg = ActorConfig(model_path=path, micro_batch_size=3)
out = Actor(mesh, cfg).log_probs(local, temperature=0.7, with_entropy=True)
ref = Reference(mesh, cfg).log_probs(local, temperature=0.7)
# oracle: a plain transformers forward of the whole sequence
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
with torch.no_grad():
    logits = hf(input_ids=local["input_ids"], attention_mask=local["attention_mask"],
                position_ids=position_ids(local["attention_mask"])).logits
R = local["response_mask"].shape[1]
logp_all = torch.log_softmax(logits[:, -R - 1:-1] / 0.7, -1)
expect = logp_all.gather(-1, local["responses"].unsqueeze(-1)).squeeze(-1)
mask = local["response_mask"].bool()
entropy = -(logp_all.exp() * logp_all).sum(-1)
print("diff", rank, (out["old_log_probs"] - expect)[mask].abs().max().item(),
      (out["entropy"] - entropy)[mask].abs().max().item(),
      (ref["ref_log_probs"] - expect)[mask].abs().max().item(), flush=True)
assert (out["old_log_probs"][~mask] == 0).all()
assert torch.allclose(out["old_log_probs"][mask], expect[mask], atol=1e-5)
assert torch.allclose(out["entropy"][mask], entropy[mask], atol=1e-5)
assert torch.allclose(ref["ref_log_probs"][mask], expect[mask], atol=1e-5)
dist.destroy_process_group()
