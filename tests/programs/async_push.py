"""The actor's weights pushed to a rollout group on other ranks arrive bit for bit; run by
test_async.py on 4 ranks: the actor FSDP-sharded on ranks 0-1, the rollout group on 2-3.

    async_push.py MODEL DTYPE     (DTYPE: float32 or bfloat16)
"""
import sys

import torch

import hflow
from hflow.batch import Batch
from hflow.runtime.dispatch import dispatch
from hflow.workers import Actor, ActorConfig, FSDPConfig, OptimConfig, RolloutConfig
from hflow.workers.rollout import Rollout

def pg_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return -(mb["advantages"] * logp * mask).sum() / mask.sum(), {}


class CheckedActor(Actor):
    @dispatch("all")
    def full_weights(self, dtype: str) -> dict[str, torch.Tensor]:
        """Every parameter gathered in full and cast to the engine's dtype (collective)."""
        return {name: p.full_tensor().to(getattr(torch, dtype)) for name, p in self.model.named_parameters()}


class CheckedRollout(Rollout):
    @dispatch("all")
    def all_engine_weights(self) -> dict[str, torch.Tensor]:
        """Rollout.engine_weights on every rank of the group, not only the first."""
        return {name: t.detach().clone() for name, (t, _) in self.llm.model.weight_targets().items()}


def check_equal(actor, rollout, when: str, dtype: str = "float32") -> dict[str, torch.Tensor]:
    expect = actor.full_weights(dtype)[0]
    for rank, got in zip(rollout.ranks, rollout.all_engine_weights()):
        if "lm_head.weight" not in expect:   # tied: the engine's head is the embedding
            got.pop("lm_head.weight")
        assert got.keys() == expect.keys(), (rank, sorted(set(got) ^ set(expect)))
        for name, tensor in expect.items():
            assert got[name].dtype == tensor.dtype, (name, got[name].dtype)
            assert torch.equal(got[name], tensor), f"{when}: rank {rank} {name} differs"
    print(f"{when}: {len(expect)} tensors equal bit for bit on ranks {rollout.ranks}", flush=True)
    return expect


def main(cluster, _):
    path, dtype = sys.argv[1], sys.argv[2]
    cfg = ActorConfig(model_path=path, optim=OptimConfig(lr=2e-2), fsdp=FSDPConfig(param_dtype=dtype))
    actor = cluster.spawn(CheckedActor, cfg, ranks=[0, 1])
    rollout_cfg = RolloutConfig(n=2, max_tokens=6, temperature=0.8, progress=False)
    rollout = cluster.spawn(CheckedRollout, cfg, rollout_cfg, ranks=[2, 3])
    manifest = actor.weight_manifest()
    g = torch.Generator().manual_seed(0)
    prompts = Batch({"prompt_ids": [torch.randint(3, 101, (int(k),), generator=g).tolist()
                                    for k in torch.randint(1, 9, (6,), generator=g)]})
    # 4 KiB buckets: many of them, and the tensors larger than a bucket go alone
    previous = None
    for version, bucket_bytes in ((0, 256 << 20), (1, 4096), (2, 4096)):
        pushed = actor.push_weights.future(rollout.ranks, bucket_bytes)
        waited = rollout.receive_weights(version, manifest, actor.ranks[0], bucket_bytes)
        sent = pushed.result()
        assert sent[0]["push_bytes"] > 0 and sent[1]["push_bytes"] == 0, sent   # one sender
        assert all(w >= 0 for w in waited)
        weights = check_equal(actor, rollout, f"version {version}", dtype)
        if previous is not None:   # the update changed them, and the push carried the change
            assert any(not torch.equal(weights[k], previous[k]) for k in weights)
        previous = weights
        batch = rollout.generate(prompts, rollout_cfg)
        assert batch["policy_version"].tolist() == [version] * 12
        mask = batch["response_mask"].bool()
        gap = (actor.log_probs(batch, 0.8)["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max().item()
        print(f"version {version}: engine vs trainer log-probs {gap:.2e}", flush=True)
        if dtype == "float32":
            assert gap < 1e-4, gap
        batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g)
        actor.update(batch, pg_loss)   # the next version


if __name__ == "__main__":
    hflow.launch(main)
