"""A partial rollout: weights pushed while the rollout group generates are taken between two
engine steps, and each token's log-prob is that of the policy that sampled it. Run by
test_partial_rollouts.py on 2 ranks: the actor and a frozen reference (the starting weights,
version 0) on rank 0, the rollout group on rank 1.

    partial_rollout.py MODEL
"""
import sys

import torch

import hflow
from hflow.batch import Batch
from hflow.workers import ActorConfig, OptimConfig, Reference, RolloutConfig

from async_push import CheckedActor, CheckedRollout, check_equal, pg_loss  # noqa: F401 (spawned classes)


def main(cluster, _):
    path = sys.argv[1]
    cfg = ActorConfig(model_path=path, optim=OptimConfig(lr=2e-2))
    actor = cluster.spawn(CheckedActor, cfg, ranks=[0])
    before = cluster.spawn(Reference, cfg, ranks=[0])      # version 0, for the oracle
    short = RolloutConfig(n=2, max_tokens=4, temperature=1.0, progress=False)
    long = RolloutConfig(n=2, max_tokens=40, temperature=1.0, progress=False, seed=5)
    rollout = cluster.spawn(CheckedRollout, cfg, long, True, ranks=[1])
    manifest, source = actor.weight_manifest(), actor.ranks[0]
    g = torch.Generator().manual_seed(0)
    prompts = Batch({"prompt_ids": [torch.randint(3, 101, (int(k),), generator=g).tolist()
                                    for k in torch.randint(2, 9, (6,), generator=g)]})

    pushed = actor.push_weights.future(rollout.ranks)
    rollout.receive_weights(0, manifest, source)
    pushed.result()
    batch = rollout.generate(prompts, short)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g)
    actor.update(batch, pg_loss)   # version 1, not pushed yet

    # the offer first, so that the generation sees it after its first step (in a run it follows the
    # push, and the generation takes it at whichever step it arrives)
    rollout.offer_weights.future(1).result()
    generated = rollout.generate.future(prompts, long)
    pushed = actor.push_weights.future(rollout.ranks)
    waited = rollout.receive_weights(1, manifest, source)
    batch = generated.result()
    pushed.result()
    print(f"the queued receive_weights waited {waited[0]:.3f} s", flush=True)
    check_equal(actor, rollout, "after the partial rollout")   # the engine holds version 1 bit for bit

    mask = batch["response_mask"].bool()
    versions = batch["token_policy_version"]
    assert batch["policy_version"].tolist() == [0] * len(batch)
    assert (versions[:, 0] == 0).all() and (versions[mask] <= 1).all(), versions
    spans = [(row[m] == 1).any().item() for row, m in zip(versions, mask)]
    assert sum(spans) >= len(batch) // 2, (spans, versions)   # the responses that outlived the first step
    # each token's engine log-prob is that of the weights that sampled it: version 0 then 1
    old = before.log_probs(batch, 1.0)["ref_log_probs"]
    new = actor.log_probs(batch, 1.0)["old_log_probs"]
    expected = torch.where(versions == 0, old, new)
    gap = (expected - batch["rollout_log_probs"])[mask].abs().max().item()
    moved = (old - new)[mask & (versions == 1)].abs().max().item()
    print(f"engine vs the sampling policy's log-probs {gap:.2e}; versions 0 and 1 differ by up to {moved:.2e}",
          flush=True)
    assert gap < 1e-4 and moved > 100 * gap, (gap, moved)


if __name__ == "__main__":
    hflow.launch(main)
