"""The safety task's starting policy: the warmed-up default taught to refuse a random fifth of
all problems, so that Safe-RLHF has refusals to sample and must learn which problems to refuse
(hflow.data.safety: subtractions are forbidden, a refusal is a response with no digit)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hflow.runtime import stopping
from hflow.algos import nll_loss
from hflow.data import PromptSampler
from hflow.default.cache import build_once
from hflow.recipe_kit.text_batches import supervised_batch
from hflow.workers import Actor, ActorConfig, OptimConfig

# Bump when refusing_policy's settings change what it builds: its cache directory carries it.
REFUSING_POLICY_VERSION = 3


def refusing_policy(cluster, policy_dir: str, train, tokenizer, refusal_rate: float = 0.2, steps: int = 30,
                    lr: float = 3e-4, batch_size: int = 128) -> str:
    """The embedded default's starting policy for Safe-RLHF: the warmed-up policy after `steps`
    supervised steps in which the target is a refusal (EOS at once) for a random
    `refusal_rate` of the problems, whatever they are, and the answer otherwise. The warm-up
    alone refuses with probability ~1e-4, too rare for RL ever to sample; this one refuses ~22 %
    of problems, not knowing which are forbidden (an SFT model that can refuse). Built once,
    cached next to the warm-up."""
    final = Path(policy_dir).with_name(f"{Path(policy_dir).name}-refuse{refusal_rate:g}-s{steps}-v{REFUSING_POLICY_VERSION}")

    def teach_refusals(out: Path) -> None:
        optim = OptimConfig(lr=lr, grad_clip=0.0)
        actor = cluster.spawn(Actor, ActorConfig(model_path=policy_dir, optim=optim, micro_batch_size=batch_size))
        print(f"teaching the warmed-up default to refuse {refusal_rate:.0%} of problems at random (once; cached "
              f"in {final})", flush=True)
        sampler = PromptSampler(train, batch_size, shuffle=True, seed=1)
        generator = torch.Generator().manual_seed(0)
        for step in range(1, steps + 1):
            stopping.stop_if_asked(f"while teaching the default to refuse (step {step} of {steps}; nothing "
                                   "cached: it is taught again next time)")
            rows = next(sampler)
            refuse = (torch.rand(len(rows), generator=generator) < refusal_rate).tolist()
            actor.update(supervised_batch([dataclasses.replace(p, ground_truth="") if r else p
                                           for p, r in zip(rows, refuse)], tokenizer), nll_loss)
        actor.export_hf(str(out), policy_dir)
        actor.close()

    return str(build_once(final, teach_refusals))
