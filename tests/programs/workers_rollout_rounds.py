"""Several sample rounds on one set of loaded weights: begin_rollout, two sample calls and
end_rollout give the batches two generate calls give, with the engine's weights loaded once;
what a rollout's state forbids is refused. Run by
test_workers.py::test_sample_rounds_share_one_weight_load."""
import sys
from dataclasses import replace

import torch

import hflow
from hflow.batch import Batch
from hflow.runtime.dispatch import dispatch
from hflow.engine import LLM
from hflow.workers import Actor, ActorConfig, RolloutConfig

path, tps = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]

# every rank counts the weight loads of its engine
weight_loads = [0]
_load_weights = LLM.load_weights


def counted_load_weights(self, named_tensors):
    weight_loads[0] += 1
    return _load_weights(self, named_tensors)


LLM.load_weights = counted_load_weights


def pg_loss(logp, mb, entropy=None):
    return -logp.sum(), {}


class CountingActor(Actor):
    @dispatch("all")
    def weight_loads(self) -> int:
        return weight_loads[0]

    @dispatch("all")
    def refusals(self, prompts: Batch, rollout: RolloutConfig) -> list[str]:
        """What this rank says, inside one call (a worker error would end the run), to: a sample
        before begin_rollout; an update, a load, a second begin_rollout and a sample of another
        tp size while a rollout is open; an end_rollout after it was closed."""
        said = []

        def attempt(method, *args):
            try:
                method(*args)
                said.append("accepted")
            except (RuntimeError, ValueError) as e:
                said.append(str(e))
        attempt(self.sample, prompts, rollout)
        self.begin_rollout(rollout)
        attempt(self.update, prompts, pg_loss)
        attempt(self.load, "no-such-checkpoint")
        attempt(self.begin_rollout, rollout)
        attempt(self.sample, prompts, replace(rollout, tp_size=2 * rollout.tp_size))
        self.end_rollout()
        attempt(self.end_rollout)
        return said


def columns(batch: Batch) -> dict:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def main(cluster, _):
    actor = cluster.spawn(CountingActor, ActorConfig(model_path=path))
    world = len(actor.ranks)
    g = torch.Generator().manual_seed(0)
    # prompts and responses shorter than a KV block: no prefix is cached from one round to the
    # next, so the second round computes exactly what a fresh engine does (log-probs too)
    prompts = Batch({"prompt_ids": [torch.randint(3, 101, (int(k),), generator=g).tolist()
                                    for k in torch.randint(1, 9, (6,), generator=g)],
                     "answer": [str(i) for i in range(6)]})
    for tp in tps:
        rollout = RolloutConfig(n=2, max_tokens=6, temperature=1.0, tp_size=tp, progress=False)
        rounds = [replace(rollout, seed=11), replace(rollout, seed=12, n=3, temperature=0.7)]
        start = actor.weight_loads()
        generated = [actor.generate(prompts, r) for r in rounds]
        after_generate = actor.weight_loads()
        actor.begin_rollout(rollout)
        sampled = [actor.sample(prompts, r) for r in rounds]
        actor.end_rollout()
        after_sample = actor.weight_loads()
        assert [b - a for a, b in zip(start, after_generate)] == [2] * world, (start, after_generate)
        assert [b - a for a, b in zip(after_generate, after_sample)] == [1] * world, (after_generate, after_sample)
        for one, other in zip(generated, sampled):
            assert one.meta == other.meta and columns(one) == columns(other), tp
        assert len(sampled[0]) == 12 and len(sampled[1]) == 18 and sampled[1].meta["temperature"] == 0.7
        print(f"tp {tp}: two sample rounds on one weight load equal two generate calls", flush=True)

    said = actor.refusals(prompts, RolloutConfig(n=2, max_tokens=6, progress=False))
    assert all(s == said[0] for s in said), said
    expected = ["sample without begin_rollout", "actor.update between begin_rollout and end_rollout",
                "actor.load between begin_rollout and end_rollout", "begin_rollout while a rollout is open",
                "sample with --rollout.tp-size 2 in a rollout begun with 1", "end_rollout without begin_rollout"]
    assert len(said[0]) == len(expected) and all(e in s for e, s in zip(expected, said[0])), said[0]
    print("refusals ok", flush=True)


if __name__ == "__main__":
    hflow.launch(main)
