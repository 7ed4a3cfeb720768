"""Export of a trained FSDP2 model; run by test_checkpoint.py::test_export_loads_with_from_pretrained_and_gives_the_same_logits."""
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

# importing checkpoint_common joins the gloo process group
from checkpoint_common import RANK, ROOT, build, train_step
from hflow import checkpoint as ck
from hflow.default.model import build_tokenizer

model, opt, sched = build(0)
for _ in range(2):
    train_step(model, opt, sched)
x = torch.randint(3, 500, (3, 10))
with torch.no_grad():
    logits = model(x).logits                  # the trained, still-sharded model
out = ck.export_hf(model, os.path.join(ROOT, "hf"), tokenizer=build_tokenizer())
if RANK == 0:
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.config.architectures == ["Qwen2ForCausalLM"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, logits)
    assert AutoTokenizer.from_pretrained(out).encode("12+35=") == build_tokenizer().encode("12+35=")
params = {n: p.full_tensor() for n, p in model.named_parameters()}   # collective: all ranks
if RANK == 0:   # every exported parameter equals the gathered training parameter exactly
    exported = dict(loaded.named_parameters())
    for name, value in params.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0)
    print("export ok")
# tearing down gloo groups sometimes aborts a rank at exit ("terminate called without an active
# exception") after every check passed: leave at once once everyone is done (as fsdp_loss_agg.py)
dist.barrier()
sys.stdout.flush()
os._exit(0)
