"""recipes/distill.py: the per-token divergences against their formulas and TRL's GKD, the student's
per-token signal on 2 ranks against transformers' own forwards of student and teacher, and the
recipe end to end (the held-out distance to the teacher falls)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dist import torchrun
from hflow.algos.distill import distill_loss, token_divergence
from hflow.default.model import build_default
from hflow.recipe_kit.teacher import teacher_dir
from hflow.validation import ConfigError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def by_hand(student_logits, teacher_logits, beta=None):
    """KL(s || t) (beta None) or GKD's generalised JSD, position by position, in float64 from the
    softmax: sum_v p(v) log(p(v) / q(v)) as written."""
    out = []
    for s_row, t_row in zip(student_logits.double(), teacher_logits.double()):
        p, q = s_row.softmax(-1), t_row.softmax(-1)

        def kl(a, b):
            return sum(float(a[v]) * (float(a[v].log()) - float(b[v].log())) for v in range(len(a)))
        if beta is None:
            out.append(kl(p, q))
        else:
            m = (1 - beta) * p + beta * q
            out.append(beta * kl(q, m) + (1 - beta) * kl(p, m))
    return torch.tensor(out, dtype=torch.float64)


def test_reverse_kl_and_jsd_are_their_formulas():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 11, generator=g) * 2, torch.randn(6, 11, generator=g) * 2
    assert token_divergence(student, teacher).double() == pytest.approx(by_hand(student, teacher), abs=1e-5)
    for beta in (0.1, 0.5, 0.9):
        assert token_divergence(student, teacher, "jsd", beta).double() == pytest.approx(
            by_hand(student, teacher, beta), abs=1e-5)
    # the endpoints: beta 1 is the reverse KL, beta 0 the forward one
    assert torch.allclose(token_divergence(student, teacher, "jsd", 1.0), token_divergence(student, teacher))
    assert torch.allclose(token_divergence(student, teacher, "jsd", 0.0), token_divergence(teacher, student))
    assert float(token_divergence(student, student).abs().max()) < 1e-6
    with pytest.raises(ValueError, match="unknown divergence"):
        token_divergence(student, teacher, "tvd")
    with pytest.raises(ValueError, match="share the vocabulary"):
        token_divergence(student, teacher[:, :10])


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_jsd_equals_trls_gkd(beta):
    trl = pytest.importorskip("trl")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
    assert trl.__version__.startswith("1."), trl.__version__
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 5, 17, generator=g) * 3, torch.randn(2, 5, 17, generator=g) * 3
    theirs = GKDTrainer.generalized_jsd_loss(student, teacher, beta=beta, reduction="none").sum(-1)
    ours = token_divergence(student.flatten(0, 1), teacher.flatten(0, 1), "jsd", beta).view(2, 5)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_distill_loss_is_the_divergences_token_mean_plus_the_weighted_policy_loss():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    divergence = torch.tensor([[0.2, 0.4, 9.0], [0.1, 0.3, 0.5]], requires_grad=True)
    log_probs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.1, -3.0]], requires_grad=True)
    mb = {"response_mask": mask, "divergence": divergence, "advantages": torch.tensor([[1.0] * 3, [-2.0] * 3]),
          "student_token_log_probs": log_probs.detach(), "teacher_token_log_probs": torch.full((2, 3), -1.0)}
    loss, metrics = distill_loss(log_probs, mb)
    assert loss.item() == pytest.approx(1.5 / 5)   # the padding's 9.0 left out
    assert metrics["sampled_kl"] == pytest.approx((0.0 - 1.0 + 0.5 + 0.9 - 2.0) / 5)   # log p_s - log p_t
    # at ratio 1 the clipped policy loss is -mean_t A: -(1 + 1 - 2 - 2 - 2) / 5
    loss, metrics = distill_loss(log_probs, mb, reward_weight=0.5)
    assert metrics["policy_loss"] == pytest.approx(4 / 5)
    assert loss.item() == pytest.approx(1.5 / 5 + 0.5 * 4 / 5)
    loss.backward()   # the policy term's gradient: -w A / tokens on each sampled token
    assert log_probs.grad[0].tolist() == pytest.approx([-0.1, -0.1, 0.0])
    assert log_probs.grad[1].tolist() == pytest.approx([0.2, 0.2, 0.2])


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny student and a tiny teacher (another seed) with the same tokenizer."""
    root = tmp_path_factory.mktemp("tiny_pair")
    return build_default(root / "student", "tiny", seed=0), build_default(root / "teacher", "tiny", seed=1)


SIGNAL_PROGRAM = '''
import sys
import torch
import hflow
from hflow.batch import Batch
from hflow.workers import ActorConfig, RolloutConfig
from hflow.workers.teacher import StudentWithTeacher

student, teacher, out = sys.argv[1:4]


def main(cluster, _):
    worker = cluster.spawn(StudentWithTeacher, ActorConfig(model_path=student, max_tokens_per_micro_batch=40),
                           teacher)
    prompts = Batch({"prompt_ids": [[5 + i, 9, 11 + i][: 1 + i % 3] for i in range(6)]})
    batch = worker.generate(prompts, RolloutConfig(n=2, max_tokens=7, temperature=1.0, seed=3))
    signals = worker.divergence(batch)
    keys = ("divergence", "student_token_log_probs", "teacher_token_log_probs")
    torch.save({k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")} | {k: signals[k] for k in keys}, out)


hflow.launch(main)
'''


@pytest.mark.dist
def test_the_per_token_signal_is_the_exact_reverse_kl_of_transformers_forwards(tiny_pair, tmp_path):
    """On 2 ranks, several packed micro-batches: every sampled position's divergence equals
    KL(student || teacher) over the vocabulary from transformers' own unpadded forwards."""
    student_dir, teacher_dir = tiny_pair
    out = tmp_path / "signals.pt"
    torchrun(SIGNAL_PROGRAM, 2, [student_dir, teacher_dir, out], timeout=300, tmp_path=tmp_path).check()
    got = torch.load(out)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    R = got["response_mask"].shape[1]
    checked = 0
    for i in range(len(got["input_ids"])):
        real = got["attention_mask"][i].bool()
        ids = got["input_ids"][i][real][None]
        responded = int(got["response_mask"][i].sum())
        with torch.no_grad():
            s, t = (m(input_ids=ids).logits[0].double() for m in (student, teacher))
        # the last `responded` tokens are the response; each is predicted from the position before it
        at = slice(ids.shape[1] - responded - 1, ids.shape[1] - 1)
        s_logp, t_logp = s[at].log_softmax(-1), t[at].log_softmax(-1)
        exact = (s_logp.exp() * (s_logp - t_logp)).sum(-1)
        tokens = ids[0, -responded:]
        cols = got["response_mask"][i].bool()
        assert got["divergence"][i][cols].double() == pytest.approx(exact, abs=2e-6, rel=1e-4)
        assert got["student_token_log_probs"][i][cols].double() == pytest.approx(
            s_logp.gather(-1, tokens[:, None]).squeeze(-1), abs=1e-5)
        assert got["teacher_token_log_probs"][i][cols].double() == pytest.approx(
            t_logp.gather(-1, tokens[:, None]).squeeze(-1), abs=1e-5)
        assert not got["divergence"][i][~cols].any() and cols.sum() == responded <= R
        checked += responded
    assert checked > 12 and float(got["divergence"][got["response_mask"].bool()].min()) > 0


def metrics_rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.parametrize("divergence,reward_weight", [("reverse_kl", 0.0), ("jsd", 0.5)])
def test_distilling_lowers_the_held_out_distance_to_the_teacher(tiny_pair, tmp_path, divergence, reward_weight):
    student_dir, teacher_dir = tiny_pair
    out = tmp_path / "distill"
    args = ["--model.path", student_dir, "--distill.teacher", teacher_dir, "--distill.divergence", divergence,
            "--distill.reward-weight", reward_weight, "--trainer.steps", 4, "--trainer.eval-every", 4,
            "--trainer.eval-size", 16, "--data.batch-size", 4, "--rollout.n", 2, "--rollout.max-tokens", 8,
            "--actor.optim.lr", 1e-3, "--trainer.output-dir", out, "--trainer.logging.no-progress-bars"]
    torchrun(str(RECIPES / "distill.py"), 2, args, timeout=300).check()
    logged = metrics_rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2, 3, 4]
    before, after = logged[0]["eval/teacher_kl"], logged[4]["eval/teacher_kl"]
    assert before > 0 and after < 0.8 * before, (before, after)
    for row in logged[1:]:
        expected = row["actor/divergence"] + reward_weight * row.get("actor/policy_loss", 0.0)
        assert row["actor/loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
        assert ("actor/policy_loss" in row) == (reward_weight > 0)
    AutoModelForCausalLM.from_pretrained(out / "actor_hf")


def test_a_run_without_a_teacher_or_with_anothers_tokenizer_is_refused(tiny_pair):
    student, teacher = tiny_pair
    tokenizer = AutoTokenizer.from_pretrained(student)
    with pytest.raises(ConfigError, match="--distill.teacher is required"):
        teacher_dir("", tokenizer)
    assert teacher_dir(str(teacher), tokenizer) == str(teacher)
    tokenizer.add_tokens(["<another>"])   # a tokenizer that is not the teacher's
    with pytest.raises(ValueError, match="not the policy's"):
        teacher_dir(str(teacher), tokenizer)
