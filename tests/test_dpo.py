"""recipes/dpo.py: the DPO and IPO losses against TRL's DPOTrainer on the same tensors, the
recipe end to end on 2 CPU ranks, and the reference's log-probs computed once."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist import torchrun
from hflow.algos import dpo_loss, dpo_pair_loss, sequence_log_probs
from hflow.default.model import build_default

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


# ---------------------------------------------------------------- the losses against TRL's

class _Gather:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def trl_dpo(loss_type: str, beta: float, input_ids, attention_mask, completion_mask, token_logps, ref_chosen,
            ref_rejected):
    """TRL 1.16's own DPOTrainer._compute_loss on a batch [chosen..., rejected...] with
    precomputed reference log-probs: `self` carries only what that method reads, and the model
    is a stand-in whose fused LM head returns `token_logps` [2B, L-1] (0 off the completion, as
    TRL's labels of -100 make it). Returns (loss, the trainer's logged metrics)."""
    trl = pytest.importorskip("trl")
    from trl.trainer.dpo_trainer import DPOTrainer
    assert trl.__version__.startswith("1."), trl.__version__
    zeros = torch.zeros_like(token_logps)
    outputs = SimpleNamespace(log_probs=token_logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    model = lambda **kwargs: outputs   # noqa: E731
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Gather(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=0.0, use_weighting=False, _metrics={"train": _defaultdict()},
        _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _defaultdict():
    from collections import defaultdict
    return defaultdict(list)


def random_pairs(pairs: int = 6, length: int = 12, seed: int = 0):
    """A TRL-layout batch (chosen rows, then rejected rows) of prompts and completions of
    different lengths, with random per-token log-probs on the completions."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * pairs
    input_ids = torch.randint(3, 100, (rows, length), generator=g)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    completion_mask = torch.zeros(rows, length, dtype=torch.long)
    for i in range(rows):
        start = int(torch.randint(1, 5, (1,), generator=g))
        end = int(torch.randint(start + 1, length + 1, (1,), generator=g))
        completion_mask[i, start:end] = 1
        attention_mask[i, end:] = 0
    shifted = completion_mask[:, 1:]
    token_logps = -torch.rand(rows, length - 1, generator=g, dtype=torch.float64) * 3 * shifted
    ref_chosen = -torch.rand(pairs, generator=g, dtype=torch.float64) * 10
    ref_rejected = -torch.rand(pairs, generator=g, dtype=torch.float64) * 10
    return input_ids, attention_mask, completion_mask, token_logps, ref_chosen, ref_rejected


def hflow_layout(completion_mask, token_logps, ref_chosen, ref_rejected):
    """The same pairs as Actor.update hands dpo_pair_loss a micro-batch: pair i as rows 2i
    (chosen) and 2i+1 (rejected), per-token log-probs [2B, R] beside a response_mask."""
    pairs = len(ref_chosen)
    order = torch.stack([torch.arange(pairs), torch.arange(pairs) + pairs], dim=1).flatten()
    mb = {"response_mask": completion_mask[:, 1:][order].float(), "chosen": torch.tensor([1.0, 0.0] * pairs),
          "ref_logp": torch.stack([ref_chosen, ref_rejected], dim=1).flatten()}
    return token_logps[order], mb


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_and_ipo_losses_equal_trls(loss_type, beta, seed):
    batch = random_pairs(seed=seed)
    trl_loss, trl_metrics = trl_dpo(loss_type, beta, *batch)
    log_probs, mb = hflow_layout(batch[2], *batch[3:])
    loss, metrics = dpo_pair_loss(log_probs, mb, beta=beta, loss=loss_type)
    assert float(loss) == pytest.approx(float(trl_loss), abs=1e-6, rel=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        assert metrics[name] == pytest.approx(trl_metrics[name], abs=1e-6, rel=1e-6), name


def test_ipo_averages_over_tokens_and_sigmoid_is_dpo():
    """By hand: one pair, chosen 2 tokens, rejected 4 tokens."""
    pc, pr, rc, rr = (torch.tensor([v], dtype=torch.float64) for v in (-2.0, -6.0, -3.0, -5.0))
    beta = 0.25
    h = (-2.0 + 3.0) - (-6.0 + 5.0)   # 2
    assert float(dpo_loss(pc, pr, rc, rr, beta)) == pytest.approx(-torch.nn.functional.logsigmoid(
        torch.tensor(beta * h, dtype=torch.float64)).item())
    ipo = dpo_loss(pc, pr, rc, rr, beta, "ipo", torch.tensor([2.0]), torch.tensor([4.0]))
    assert float(ipo) == pytest.approx((1.0 / 2 - (-1.0) / 4 - 1 / (2 * beta)) ** 2)
    with pytest.raises(ValueError, match="ipo"):
        dpo_loss(pc, pr, rc, rr, beta, "ipo")
    with pytest.raises(ValueError, match="unknown DPO loss"):
        dpo_loss(pc, pr, rc, rr, beta, "hinge")


def test_sequence_log_probs_ignore_what_the_mask_leaves_out():
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("inf"), -0.25]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    total, tokens = sequence_log_probs(logp, mask)
    assert total.tolist() == [-3.0, -0.75] and tokens.tolist() == [2.0, 2.0]


def test_dpo_pair_loss_wants_the_pair_layout():
    log_probs, mb = hflow_layout(*random_pairs()[2:])
    with pytest.raises(ValueError, match="pair layout"):
        dpo_pair_loss(log_probs, {**mb, "chosen": mb["chosen"].flip(0)})


# ---------------------------------------------------------------- the recipe

def recipe_module():
    spec = importlib.util.spec_from_file_location("dpo_recipe", RECIPES / "dpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class CountingReference:
    """A stand-in Reference: per-token log-probs -(row + 1) / 10 on every response token."""

    def __init__(self):
        self.calls, self.rows = 0, 0

    def log_probs(self, batch):
        self.calls += 1
        self.rows += len(batch["input_ids"])
        rows = torch.arange(len(batch["input_ids"]), dtype=torch.float32)[:, None] + 1
        return {"ref_log_probs": -rows / 10 * batch["response_mask"]}


def test_the_reference_scores_each_pair_once_and_batches_carry_it():
    dpo = recipe_module()
    pairs = [([1, 5, 6], [7] * (1 + i % 3) + [2], [8, 2], None, None) for i in range(10)]
    ref = CountingReference()
    scored, calls = dpo.with_reference(ref, pairs, 0, batch_size=4)
    assert (calls, ref.calls, ref.rows) == (3, 3, 20)   # ceil(10 / 4) calls, each pair's two rows once
    assert [p[:5] for p in scored] == pairs
    # pair i of a call is rows 2i (chosen: 1 + i % 3 + 1 tokens) and 2i + 1 (rejected: 2 tokens)
    for i, p in enumerate(scored):
        j = i % 4
        assert p[5] == pytest.approx(-(2 * j + 1) / 10 * (2 + i % 3))
        assert p[6] == pytest.approx(-(2 * j + 2) / 10 * 2)
    batch = dpo.dpo_batch(scored[2:5], 0)
    assert batch["chosen"].tolist() == [1.0, 0.0] * 3 and batch.meta["n"] == 2
    assert batch["ref_logp"].tolist() == pytest.approx([x for p in scored[2:5] for x in p[5:7]])


def metrics_rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_default(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


@pytest.mark.dist
@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_recipe_trains_reports_and_exports(tiny_model, tmp_path, loss):
    """3 steps of 8 pairs over 16 training pairs: past one epoch, and the reference still scored
    each pair once (it is closed before training)."""
    rows = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1 + a % 7)} for a in range(10, 30)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "dpo"
    args = ["--model.path", tiny_model, "--data.train-files", data, "--data.val-fraction", 0.2,
            "--data.batch-size", 8, "--steps", 3, "--eval-every", 2, "--dpo.loss", loss, "--dpo.beta", 0.5,
            "--actor.micro-batch-size", 3, "--actor.optim.lr", 1e-3,
            "--output-dir", out, "--logging.no-progress-bars"]
    torchrun(str(RECIPES / "dpo.py"), 2, args, timeout=300).check()
    logged = metrics_rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
    # 16 training and 4 held-out pairs, scored in one call each, before step 1 and never again
    assert logged[0]["ref/pairs"] == 20 and logged[0]["ref/calls"] == 2
    assert not any(k.startswith("ref/") for r in logged[1:] for k in r)
    # before any step the policy is the reference: every implicit reward is 0
    assert logged[0]["eval/rewards/chosen"] == pytest.approx(0, abs=1e-5)
    assert logged[0]["eval/rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert logged[0]["eval/loss"] == pytest.approx(0.6931472 if loss == "sigmoid" else 1.0, abs=1e-4)
    for step in (1, 2, 3):
        assert 0 <= logged[step]["actor/rewards/accuracies"] <= 1
        assert {"actor/loss", "actor/rewards/chosen", "actor/rewards/rejected", "actor/rewards/margins"} <= set(logged[step])
    # the first step's batch is scored by the reference's own weights: its loss is the untrained one
    assert logged[1]["actor/loss"] == pytest.approx(logged[0]["eval/loss"], abs=1e-4)
    for step in (2, 3):
        assert 0 <= logged[step]["eval/rewards/accuracies"] <= 1 and "eval/loss" in logged[step]
    assert logged[3]["eval/rewards/margins"] != 0
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out / "model")
