"""Qwen3-MoE under the FSDP2 trainer (tests/programs/moe_training.py, 1 and 2 CPU ranks): its
log-probs equal transformers' forward, one update on 2 ranks equals the same update on 1, the
engine samples with the updated weights (the program checks they are the trainer's exactly),
and routing replay's metric is logged by the update."""
import os

import pytest
import torch
from dist import PROGRAMS, torchrun
from test_fsdp import TESTS_ENV
from test_qwen3_moe import tiny_moe

from hflow.layout import sequence_tensors

LR = 1e-3
PROGRAM = os.path.join(PROGRAMS, "moe_training.py")


def rollouts():
    """Four GRPO groups of two, prompts and responses of varied lengths, fixed advantages."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (3, 8, 5, 12)]
    rows = [p for p in prompts for _ in range(2)]
    responses = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (4, 9, 2, 6, 7, 3, 10, 5)]
    tensors = sequence_tensors(rows, responses, pad_id=0)
    tensors["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.5, 1.5, 0.7, -0.7])[:, None] * tensors["response_mask"]
    return tensors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    tiny_moe(seed=7).save_pretrained(path)
    return path


def run_on(ranks: int, model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"moe_training_{ranks}")
    torchrun(PROGRAM, nproc=ranks, args=[model_dir, out], tmp_path=out, timeout=420, env=TESTS_ENV).check()
    return torch.load(out / "results.pt"), out / "exported"


@pytest.fixture(scope="module")
def one(model_dir, tmp_path_factory):
    return run_on(1, model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def two(model_dir, tmp_path_factory):
    return run_on(2, model_dir, tmp_path_factory)


@pytest.mark.dist
def test_log_probs_equal_transformers(two, model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tensors = rollouts()
    R = tensors["response_mask"].shape[1]
    saved, _ = two
    for i in range(len(tensors["input_ids"])):
        mask = tensors["attention_mask"][i].bool()
        ids, p = tensors["input_ids"][i][mask], int(mask[:-R].sum())
        with torch.no_grad():
            logits = model(ids[None]).logits[0, p - 1:-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, ids[p:, None])[:, 0]
        got = saved["log_probs"][i][tensors["response_mask"][i].bool()]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.dist
def test_one_update_on_two_ranks_equals_one_rank(one, two, model_dir):
    """The same loss, gradient norm and exported weights (to fp32 rounding of a reduction in
    another order), and the update moved every expert that a token was routed to: the experts'
    and routers' weights by ~lr (Adam's first step)."""
    from safetensors.torch import load_file
    (first, exported_1), (second, exported_2) = one, two
    assert first["metrics"]["actor/loss"] == pytest.approx(second["metrics"]["actor/loss"], rel=1e-5)
    assert first["metrics"]["actor/grad_norm"] == pytest.approx(second["metrics"]["actor/grad_norm"], rel=1e-4)
    a, b = load_file(exported_1 / "model.safetensors"), load_file(exported_2 / "model.safetensors")
    before = load_file(model_dir / "model.safetensors")
    assert a.keys() == b.keys() == before.keys() and "model.layers.0.mlp.experts.3.gate_proj.weight" in a
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=2e-6, rtol=0, msg=key)
    for key in ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"):
        assert (a[key] - before[key]).abs().max() == pytest.approx(LR, rel=0.01)
    moved_experts = {k.split(".experts.")[1].split(".")[0] for k in a
                     if ".experts." in k and not torch.equal(a[k], before[k])}
    assert len(moved_experts) >= 6


@pytest.mark.dist
def test_engine_samples_match_and_replay_metric_is_logged(one, two):
    for saved, _ in (one, two):
        gaps = saved["engine_gap"]
        assert gaps[False] < 1e-4 and gaps[True] < 1e-4, gaps   # fp32: the same experts, the same log-probs
        metric = saved["replay_metrics"]["actor/moe_routing_disagreement"]
        assert 0.0 <= metric < 0.01   # fp32 engine and trainer pick the same experts
        assert "actor/moe_routing_disagreement" not in saved["metrics"]   # no engine routes: nothing compared
        wrong = saved["wrong_routes"]   # every expert the engine chose shifted by one
        assert wrong["replayed_moves"] > 1e-3 and wrong["compared_moves"] == 0.0
        # a sample's prompt is forwarded once per packed group: fewer pairs compared than laid out
        assert wrong["disagreement"] == 1.0 and 0 < wrong["compared"] <= wrong["known"]


def recipe_moe_dir(path):
    """A tiny Qwen3-MoE with the default model's tokenizer and chat template (vocab 512), so the
    recipes' data and rewards run on it."""
    import shutil
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from hflow.default.model import build_default
    source = build_default(path / "tokenizer_source", "tiny", seed=0)
    model = path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(source / name, model / name)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                         eos_token_id=2, pad_token_id=0, bos_token_id=None, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(cfg).save_pretrained(model)
    return model


@pytest.mark.dist
def test_grpo_with_routing_replay_logs_the_disagreement_every_step(tmp_path):
    import json
    from pathlib import Path
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    out = tmp_path / "grpo"
    args = ["--model.path", recipe_moe_dir(tmp_path), "--trainer.output-dir", out, "--trainer.steps", 2,
            "--data.batch-size", 4, "--rollout.n", 2, "--rollout.max-tokens", 4, "--trainer.eval-size", 8,
            "--trainer.logging.no-progress-bars", "--trainer.no-export", "--actor.fsdp.param-dtype", "bfloat16",
            "--actor.moe.routing-replay"]
    torchrun(str(recipes / "grpo.py"), 2, args, timeout=400).check()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2]
    for row in logged[1:]:
        assert 0.0 <= row["actor/moe_routing_disagreement"] <= 1.0
        assert row["actor/mismatch/abs_log_ratio_max"] < 0.05   # bf16 engine vs replayed trainer
