"""The hybrid engine and log-prob parity on the device HFLOW_DEVICE picks, in fp32 or bf16; run
by tests/test_device.py (one rank: NCCL takes one process per GPU, and a GPU check may have one).

    python tests/programs/device_hybrid.py MODEL_DIR float32|bfloat16

Checks, after a rollout, an update and a second rollout:
- the engine holds exactly the training weights, cast to its dtype (the hand-off);
- the engine's sampled-token log-probs equal actor.log_probs' within TOLERANCE[dtype];
- the (frozen) Reference's log-probs equal a transformers fp32 forward on CPU within it.
Prints one line `device ... dtype ... engine-vs-training ... rollout-vs-actor ... ref-vs-hf ...`.
"""
import sys

import torch
from transformers import AutoModelForCausalLM

import hflow
from hflow.batch import Batch
from hflow.runtime.dispatch import dispatch
from hflow.workers import Actor, ActorConfig, OptimConfig, Reference, RolloutConfig
from hflow.workers.fsdp import FSDPConfig
from hflow.layout import position_ids

# Largest |log-prob difference| accepted. fp32: rounding only (measured on CPU: 5e-7, and 0 for
# the reference). bf16 keeps 8 significant bits (a relative step of 2^-8), so two bf16
# computations with different kernels (engine vs FSDP forward; bf16 vs fp32) part by ~1e-2 of
# a log-prob of a few units: measured on CPU 4.8e-3 (rollout vs actor) and 3.0e-3 (reference vs
# fp32) on this tiny model; 0.05 leaves room for other kernels (cuBLAS, flash attention).
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}

path, dtype = sys.argv[1], sys.argv[2]
TEMPERATURE = 0.8


def pg_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return -(mb["advantages"] * logp * mask).sum() / mask.sum(), {}


class CheckedActor(Actor):
    @dispatch("all")
    def engine_vs_training(self) -> float:
        """Largest difference between the engine's weights and the training weights
        (full_tensor()) cast to the engine's dtype."""
        targets = self.hybrid_engine.llm.model.weight_targets()
        worst = 0.0
        for name, param in self.model.named_parameters():
            full = param.full_tensor().to(targets[name][0].dtype)
            worst = max(worst, (targets[name][0].float() - full.float()).abs().max().item())
        return worst

    @dispatch("all")
    def placement(self) -> str:
        w = self.hybrid_engine.llm.model.embed_tokens.weight
        return f"{w.device} {w.dtype}"


def max_diff(a, b, mask):
    return (a.float().cpu() - b.float().cpu())[mask].abs().max().item()


def main(cluster, _):
    cfg = ActorConfig(model_path=path, optim=OptimConfig(lr=2e-2), fsdp=FSDPConfig(param_dtype=dtype))
    actor = cluster.spawn(CheckedActor, cfg)
    ref = cluster.spawn(Reference, cfg)
    g = torch.Generator().manual_seed(0)
    prompts = Batch({"prompt_ids": [torch.randint(3, 101, (int(k),), generator=g).tolist()
                                    for k in torch.randint(1, 9, (6,), generator=g)]})
    rollout = RolloutConfig(n=2, max_tokens=6, temperature=TEMPERATURE, free_weights_when_asleep=False)
    batch = actor.generate(prompts, rollout)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g)
    actor.update(batch, pg_loss)
    batch = actor.generate(prompts, rollout)
    engine_vs_training = max(actor.engine_vs_training())
    mask = batch["response_mask"].bool()
    rollout_vs_actor = max_diff(actor.log_probs(batch, TEMPERATURE)["old_log_probs"], batch["rollout_log_probs"], mask)
    # the oracle: transformers in fp32 on CPU, the checkpoint's (= the reference's) weights
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=position_ids(batch["attention_mask"])).logits
    R = mask.shape[1]
    expect = torch.log_softmax(logits[:, -R - 1:-1] / TEMPERATURE, -1).gather(-1, batch["responses"][..., None])[..., 0]
    ref_vs_hf = max_diff(ref.log_probs(batch, TEMPERATURE)["ref_log_probs"], expect, mask)
    print(f"device {actor.placement()[0]} dtype {dtype} engine-vs-training {engine_vs_training:.2e} "
          f"rollout-vs-actor {rollout_vs_actor:.2e} ref-vs-hf {ref_vs_hf:.2e} tolerance {TOLERANCE[dtype]:g}",
          flush=True)
    assert engine_vs_training == 0.0
    assert rollout_vs_actor <= TOLERANCE[dtype], rollout_vs_actor
    assert ref_vs_hf <= TOLERANCE[dtype], ref_vs_hf


if __name__ == "__main__":
    hflow.launch(main)
