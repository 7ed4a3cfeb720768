"""actor.generate(with_greedy=True): one greedy row per prompt equal to transformers' greedy generate, samples unchanged; run by test_remax.py::test_generate_with_greedy."""
import sys

import torch
from transformers import AutoModelForCausalLM

import hflow
from hflow.batch import Batch
from hflow.workers import Actor, ActorConfig, RolloutConfig
from hflow.workers.rollout_batches import split_greedy

path, tps = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
N, MAX_TOKENS = 3, 6


def rows_as_lists(batch: Batch) -> list[list[int]]:
    lengths = batch["response_mask"].sum(1).long().tolist()
    return [row[:k].tolist() for row, k in zip(batch["responses"], lengths)]


def main(cluster, _):
    actor = cluster.spawn(Actor, ActorConfig(model_path=path))
    g = torch.Generator().manual_seed(0)
    # 5 prompts: the dp dispatch pads them to an even count, and the padding must not leak into the rows
    prompt_ids = [torch.randint(3, 101, (int(k),), generator=g).tolist() for k in torch.randint(1, 9, (5,), generator=g)]
    prompts = Batch({"prompt_ids": prompt_ids, "answer": [str(i) for i in range(5)]})
    model = AutoModelForCausalLM.from_pretrained(path)
    expected_greedy = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                       for p in prompt_ids]
    for tp in tps:
        rollout = RolloutConfig(n=N, max_tokens=MAX_TOKENS, temperature=1.0, tp_size=tp, seed=7, progress=False)
        both = actor.generate(prompts, rollout, with_greedy=True)
        assert len(both) == 5 * (N + 1) and both.meta["n"] == N + 1, (len(both), both.meta)
        assert both["greedy"].tolist() == [j == N for _ in range(5) for j in range(N + 1)]
        assert both["answer"] == [str(i) for i in range(5) for _ in range(N + 1)]

        sampled, greedy = split_greedy(both)
        assert "greedy" not in sampled and sampled.meta["n"] == N and greedy.meta == {**greedy.meta, "n": 1, "temperature": 0.0}
        assert greedy["answer"] == [str(i) for i in range(5)]
        assert rows_as_lists(greedy) == expected_greedy, (tp, rows_as_lists(greedy), expected_greedy)
        alone = actor.generate(prompts, rollout)   # the greedy requests do not change the samples' streams
        assert rows_as_lists(sampled) == rows_as_lists(alone), tp
        assert sampled["answer"] == alone["answer"]
        print(f"tp {tp}: greedy rows equal transformers' generate, samples unchanged", flush=True)


if __name__ == "__main__":
    hflow.launch(main)
