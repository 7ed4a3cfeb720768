"""The hybrid engine holds the training weights after updates; run by test_workers.py::test_engine_follows_training_weights."""
import sys, torch
import hflow
from hflow.batch import Batch
from hflow.runtime.dispatch import dispatch
from hflow.distributed.reshard import tensor_parallel_dim
from hflow.workers import Actor, ActorConfig, OptimConfig, RolloutConfig

path, tps = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]


def pg_loss(logp, mb, entropy=None):
    mask = mb["response_mask"]
    return -(mb["advantages"] * logp * mask).sum() / mask.sum(), {}


class CheckedActor(Actor):
    @dispatch("all")
    def engine_vs_training(self) -> float:
        """Largest difference between the engine's weights and full_tensor() of the training
        parameters, sliced as this rank's tensor-parallel shard."""
        targets = self.hybrid_engine.llm.model.weight_targets()
        tp, t = self.hybrid_engine.gen_mesh.size(0), self.hybrid_engine.gen_mesh.get_local_rank(0)
        worst = 0.0
        for name, param in self.model.named_parameters():
            full = param.full_tensor()
            d = tensor_parallel_dim(name)
            expect = full if d is None else full.chunk(tp, d)[t]
            worst = max(worst, (targets[name][0] - expect).abs().max().item())
        return worst


def main(cluster, _):
    actor = cluster.spawn(CheckedActor, ActorConfig(model_path=path, optim=OptimConfig(lr=2e-2)))
    g = torch.Generator().manual_seed(0)
    prompts = Batch({"prompt_ids": [torch.randint(3, 101, (int(k),), generator=g).tolist()
                                    for k in torch.randint(1, 9, (6,), generator=g)],
                     "answer": [str(i) for i in range(6)]})
    for tp in tps:
        rollout = RolloutConfig(n=2, max_tokens=6, temperature=0.8, tp_size=tp, free_weights_when_asleep=False)
        batch = actor.generate(prompts, rollout)
        assert len(batch) == 12 and batch["answer"] == [str(i) for i in range(6) for _ in range(2)]
        assert batch.meta["n"] == 2 and batch.meta["temperature"] == 0.8
        # change the weights, then check the engine follows
        batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g)
        metrics = actor.update(batch, pg_loss)[0]
        assert set(metrics) == {"actor/loss", "actor/grad_norm", "actor/lr", "actor/skipped_steps",
                                "memory/actor_peak_gib"}, metrics
        batch = actor.generate(prompts, rollout)
        worst = max(actor.engine_vs_training())
        mask = batch["response_mask"].bool()
        diff = (actor.log_probs(batch, 0.8)["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max()
        print(f"tp {tp}: engine vs training weights {worst:.2e}, log-prob diff {diff:.2e}", flush=True)
        assert worst == 0.0
        assert diff < 1e-4


if __name__ == "__main__":
    hflow.launch(main)
