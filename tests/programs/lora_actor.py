"""An Actor with LoRA adapters on real ranks: only the adapters train, the engine holds the merged
weights, a checkpoint holds the adapters alone and resumes exactly; run by
test_lora.py::test_lora_actor_trains_adapters_only_and_hands_the_engine_merged_weights."""
import json
import os
import sys

import torch

import hflow
from hflow.batch import Batch
from hflow.runtime.dispatch import dispatch
from hflow.lora import LoRAConfig, is_adapter, low_rank_delta
from hflow.distributed.reshard import tensor_parallel_dim
from hflow.workers import Actor, ActorConfig, OptimConfig, Reference, RolloutConfig

path, out, dtype = sys.argv[1], sys.argv[2], sys.argv[3]


def pg_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return -(mb["advantages"] * logp * mask).sum() / mask.sum(), {}


class CheckedActor(Actor):
    @dispatch("all")
    def engine_vs_merged(self) -> float:
        """Largest difference between the engine's weights and W + (alpha / r) B A computed from
        full_tensor() of the training parameters, sliced as this rank's tensor-parallel shard."""
        targets = self.hybrid_engine.llm.model.weight_targets()
        tp, t = self.hybrid_engine.gen_mesh.size(0), self.hybrid_engine.gen_mesh.get_local_rank(0)
        modules = dict(self.model.named_modules())
        worst = 0.0
        for name, param in self.model.named_parameters():
            if is_adapter(name):
                continue
            full = param.full_tensor().float()
            owner = modules[name.rsplit(".", 1)[0]]
            if hasattr(owner, "lora_A") and name.endswith(".weight"):
                full = full + low_rank_delta(owner.lora_A.full_tensor(), owner.lora_B.full_tensor(), owner.lora_scaling)
            d = tensor_parallel_dim(name)
            expect = full if d is None else full.chunk(tp, d)[t]
            worst = max(worst, (targets[name][0].float() - expect).abs().max().item())
        return worst

    @dispatch("all")
    def training_state(self) -> dict:
        params = dict(self.model.named_parameters())
        optimized = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        return {"trained": sorted(n for n, p in params.items() if p.requires_grad),
                "optimized": sorted(n for n, p in params.items() if id(p) in optimized),
                "dtypes": sorted({str(p.dtype) for n, p in params.items() if not p.requires_grad}),
                "adapter_dtypes": sorted({str(p.dtype) for n, p in params.items() if p.requires_grad})}


def main(cluster, _):
    fsdp = {"param_dtype": dtype, "shard_size": cluster.world_size}   # sharded: FSDP2 gathers the adapters too
    from hflow.workers.fsdp import FSDPConfig
    cfg = ActorConfig(model_path=path, optim=OptimConfig(lr=2e-2), lora=LoRAConfig(rank=4, alpha=8.0),
                      fsdp=FSDPConfig(**fsdp))
    actor = cluster.spawn(CheckedActor, cfg)
    base = cluster.spawn(Reference, ActorConfig(model_path=path, fsdp=FSDPConfig(**fsdp)))
    g = torch.Generator().manual_seed(0)
    prompts = Batch({"prompt_ids": [torch.randint(3, 101, (int(k),), generator=g).tolist()
                                    for k in torch.randint(1, 9, (6,), generator=g)]})
    rollout = RolloutConfig(n=2, max_tokens=6, temperature=1.0, tp_size=cluster.world_size,
                            free_weights_when_asleep=False)
    batch = actor.generate(prompts, rollout)
    saved = {"state": actor.training_state()[0]}
    # B = 0 at the start: the adapted policy is the base, to the bit
    saved["start_gap"] = (actor.log_probs(batch)["old_log_probs"] - base.log_probs(batch)["ref_log_probs"]).abs().max().item()
    for step in range(3):
        batch = actor.generate(prompts, rollout)
        batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g)
        actor.update(batch, pg_loss)
    batch = actor.generate(prompts, rollout)
    mask = batch["response_mask"].bool()
    trained = actor.log_probs(batch)["old_log_probs"]
    saved["engine_vs_merged"] = max(actor.engine_vs_merged())
    saved["engine_vs_trainer"] = (trained - batch["rollout_log_probs"])[mask].abs().max().item()
    saved["moved_from_base"] = (trained - base.log_probs(batch)["ref_log_probs"])[mask].abs().max().item()
    actor.save(f"{out}/ckpt")
    saved["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(f"{out}/ckpt")
                                    for f in fs)
    resumed = cluster.spawn(CheckedActor, cfg)
    resumed.load(f"{out}/ckpt")
    saved["resumed_gap"] = (resumed.log_probs(batch)["old_log_probs"] - trained).abs().max().item()
    actor.export_hf(f"{out}/actor_hf", path)
    torch.save({"batch": {k: batch[k] for k in ("input_ids", "attention_mask", "responses", "response_mask")},
                "trained": trained}, f"{out}/batch.pt")
    with open(f"{out}/saved.json", "w") as f:
        json.dump(saved, f)


if __name__ == "__main__":
    hflow.launch(main)
