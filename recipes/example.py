"""A toy RL loop that shows hflow's single controller at work.

    torchrun --nproc-per-node 4 recipes/example.py            # --help lists the flags

The policy is a Gaussian N(mu, sigma^2) over one number; the reward is -(action - target)^2.
Three worker groups, placed the way an RLHF job places its models:

  Sampler  on the first half of the ranks  (split placement: like rollout workers)
  Scorer   on the second half              (split placement: like a reward model)
  Learner  on every rank                   (colocated: like the actor's training shards)

Each step the controller (rank 0) sends the Learner's current mu to the Sampler (a toy weight
sync), samples and scores in two halves so that the Sampler and the Scorer work at the same
time, computes advantages itself, and has the Learner take one REINFORCE step:

    grad_mu J = mean_i (r_i - mean r) * (a_i - mu) / sigma^2,   mu <- mu + lr * grad_mu J

averaged over the Learner's data-parallel ranks with an all_reduce. mu converges to target.
"""
from dataclasses import dataclass
import time

import torch
import torch.distributed as dist

import hflow
from hflow import Batch
from hflow.runtime.dispatch import dispatch
from hflow.placement import split


@dataclass
class Config:
    steps: int = 60
    """RL steps."""
    batch_size: int = 64
    """Samples per step (split over the data-parallel ranks of each group)."""
    lr: float = 0.1
    """Learning rate of the REINFORCE step."""
    sigma: float = 1.0
    """Standard deviation of the Gaussian policy."""
    target: float = 3.0
    """The action with the highest reward."""
    seed: int = 0
    log_every: int = 10
    """Print a line every this many steps."""


class Sampler:
    def __init__(self, mesh, sigma: float, seed: int):
        self.sigma = sigma
        # one stream per data-parallel rank, so shards draw different noise
        self.generator = torch.Generator().manual_seed(seed + mesh.get_local_rank("dp"))

    @dispatch("dp")
    def sample(self, prompts: Batch, mu: float) -> Batch:
        noise = torch.randn(len(prompts), generator=self.generator)
        return Batch({"action": mu + self.sigma * noise})


class Scorer:
    def __init__(self, mesh, target: float):
        self.target = target

    @dispatch("dp")
    def score(self, batch: Batch) -> Batch:
        return Batch({"reward": -(batch["action"] - self.target) ** 2})


class Learner:
    def __init__(self, mesh, lr: float, sigma: float):
        self.mesh, self.lr, self.sigma = mesh, lr, sigma
        self.mu = torch.zeros(())

    @dispatch("dp")
    def update(self, batch: Batch) -> dict:
        # sum of per-sample gradients and the count, summed over the dp ranks
        local = (batch["advantage"] * (batch["action"] - self.mu) / self.sigma ** 2).sum()
        totals = torch.stack([local, torch.tensor(float(len(batch)))])
        dist.all_reduce(totals, group=self.mesh.get_group("dp"))
        grad = totals[0] / totals[1]
        self.mu += self.lr * grad
        return {"grad": grad.item()}

    @dispatch("all")
    def policy(self) -> float:
        return self.mu.item()


def main(cluster: hflow.Cluster, cfg: Config):
    plan = split([["sampler"], ["scorer"]], cluster.world_size)
    sampler = cluster.spawn(Sampler, cfg.sigma, cfg.seed, ranks=plan["sampler"])
    scorer = cluster.spawn(Scorer, cfg.target, ranks=plan["scorer"])
    learner = cluster.spawn(Learner, cfg.lr, cfg.sigma)            # all ranks
    for group in (sampler, scorer, learner):
        print(f"example: {group}", flush=True)

    prompts = Batch({"prompt_id": torch.arange(cfg.batch_size)})
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        mus = learner.policy()
        assert len(set(mus)) == 1, f"the learner's replicas disagree: {mus}"   # SPMD check
        first, second = prompts.split(2)
        samples_1 = sampler.sample(first, mus[0])
        samples_2 = sampler.sample.future(second, mus[0])   # the sampler works on half 2...
        rewards_1 = scorer.score.future(samples_1)          # ...while the scorer does half 1
        samples_2 = samples_2.result()
        batch = Batch.concat([samples_1 | rewards_1.result(), samples_2 | scorer.score(samples_2)])
        batch["advantage"] = batch["reward"] - batch["reward"].mean()   # on the controller
        learner.update(batch)
        if step % cfg.log_every == 0 or step == cfg.steps:
            print(f"example: step {step:4d}  mu {mus[0]:+.3f}  mean reward "
                  f"{batch['reward'].mean():+.3f}", flush=True)
    mu = learner.policy()[0]
    seconds = time.perf_counter() - start
    print(f"example: {cfg.steps} steps in {seconds:.2f} s "
          f"({1e3 * seconds / cfg.steps:.1f} ms/step, 7 dispatched calls each); "
          f"mu = {mu:.3f}, target {cfg.target}", flush=True)
    if abs(mu - cfg.target) > 0.5:
        raise RuntimeError(f"mu = {mu:.3f} did not reach the target {cfg.target}")
    print("example: done", flush=True)


if __name__ == "__main__":
    hflow.launch(main, Config)   # rank 0 parses and checks the flags
