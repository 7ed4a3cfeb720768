"""A trainable RewardModel against transformers: scores, the Bradley–Terry loss of an update, and
the exported directory; run by test_reward_model.py::test_trained_reward_model_matches_transformers."""
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

import hflow
from hflow.data.preference import pair_batch
from hflow.algos import pair_loss
from hflow.workers import OptimConfig, RewardModel, RewardModelConfig

model_path, out = sys.argv[1:3]


def hf_scores(path, pairs):
    """Each sequence alone through transformers' own forward and pooling (no padding at all)."""
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    seqs = [prompt + response for prompt, chosen, rejected, *_ in pairs for response in (chosen, rejected)]
    with torch.no_grad():
        return torch.stack([hf(input_ids=torch.tensor([s])).logits[0, 0] for s in seqs])


def main(cluster, _):
    g = torch.Generator().manual_seed(0)
    rand = lambda low, high: torch.randint(3, 101, (int(torch.randint(low, high, (1,), generator=g)),),  # noqa: E731
                                           generator=g).tolist()
    pairs = [(rand(1, 8), rand(1, 6) + [1], rand(1, 6) + [1], None, None) for _ in range(6)]   # uneven lengths
    batch = pair_batch(pairs, pad_id=0)
    # one pair per micro-batch: each rank runs 3 micro-batches, and a pair is never cut in two
    cfg = RewardModelConfig(model_path=model_path, trainable=True, micro_batch_size=1,
                            optim=OptimConfig(lr=1e-2, grad_clip=0.0))
    rm = cluster.spawn(RewardModel, cfg)

    rm.export_hf(out + "/before")
    expect = hf_scores(out + "/before", pairs)
    got = rm.scores(batch)["rm_scores"]
    print("scores", (got - expect).abs().max().item(), flush=True)
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-5)

    # the loss an update reports is the Bradley-Terry loss of the scores before it, over all pairs
    metrics = rm.update(batch, pair_loss)[0]
    by_hand = -F.logsigmoid(expect[0::2] - expect[1::2]).mean().item()
    print("loss", metrics["rm/loss"], by_hand, flush=True)
    assert abs(metrics["rm/loss"] - by_hand) < 1e-5, (metrics, by_hand)
    assert abs(metrics["rm/accuracy"] - (expect[0::2] > expect[1::2]).float().mean().item()) < 1e-6

    rm.export_hf(out + "/after")
    after = hf_scores(out + "/after", pairs)
    assert not torch.allclose(after, expect), "the update should change the scores"
    torch.testing.assert_close(rm.scores(batch)["rm_scores"], after, rtol=0, atol=1e-5)
    print("reward model ok", flush=True)


if __name__ == "__main__":
    hflow.launch(main)
