"""Multi-turn rollouts on the engine (workers/agent_rollout.py): sessions in flight together, the
KV of earlier turns reused, log-probs and gradients honest under observation tokens, seeds that
do not depend on the batch or the ranks, a hung step that holds up nobody else.

A random model rarely ends a turn, so the model here is the embedded tiny default with its LM
head's EOS row pointed along the mean final hidden state: it ends most turns within a few
tokens. The environment answers every turn for a fixed number of turns, whatever the text:
what is tested is the engine and session plumbing, not the model's tool use.
"""
import shutil
from pathlib import Path
import threading
import time

import pytest
import torch

from hflow.agents import AgentLimits, Environment, StepResult
from hflow.batch import Batch
from hflow.default.model import build_default
from hflow.engine import LLM
from hflow.workers import packing
from hflow.agents import agent_rollout_metrics
from hflow.workers.agent_rollout import sample_agent
from hflow.workers.log_probs import token_log_probs
from hflow.workers.rollout_batches import RolloutConfig

EOS = 2


class FixedTurns(Environment):
    """Answers `turns - 1` turns with an observation, then ends (reward 1)."""
    turns = 4

    def reset(self, row):
        self.left, self.row = self.turns, row
        return row["prompt"]

    def step(self, text):
        self.left -= 1
        if self.left == 0:
            return StepResult(None, reward=1.0, done=True)
        return StepResult(f" observation {self.left} of row {self.row['prompt'][:6]}", info={"tool_calls": 1})


class OneHangs(FixedTurns):
    """Row 'hang ...' never answers its first step (well, not for a minute); the others note
    when they end."""
    ended: list = []

    def step(self, text):
        if self.row["prompt"].startswith("hang"):
            threading.Event().wait(60)
        result = super().step(text)
        if result.done:
            OneHangs.ended.append(time.monotonic())
        return result


def ending_turns_model(base, out) -> str:
    """The model at `base` with its LM head's EOS row along the mean final hidden state, saved to
    `out`: it ends most turns within a few tokens (a random model never ends one)."""
    from transformers import AutoModelForCausalLM
    base, out = Path(base), Path(out)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        h = model.model(torch.randint(3, 500, (16, 40), generator=g)).last_hidden_state.reshape(-1, model.config.hidden_size)
        mean = h.mean(0)
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.lm_head.weight[EOS] = 12 * mean / mean.norm() ** 2
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return str(out)


@pytest.fixture(scope="module")
def eot_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_model")
    return ending_turns_model(build_default(root / "base", "tiny", seed=0), root / "eot")


@pytest.fixture(scope="module")
def tokenizer(eot_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(eot_model)


def engine(path, **opts):
    return LLM.from_pretrained(path, dtype=torch.float32, kv_cache_bytes=64 << 20, block_size=4, **opts)


def rows(k, prefix="what is"):
    return Batch({"prompt": [f"{prefix} {i} plus {i}?" for i in range(k)], "answer": [str(2 * i) for i in range(k)]})


ROLLOUT = RolloutConfig(n=2, temperature=1.0, seed=7, progress=False)
LIMITS = AgentLimits(max_turns=6, max_response_tokens=160, max_turn_tokens=32)


def trajectories(batch):
    return [(r[m.bool()].tolist(), f) for r, m, f in zip(batch["input_ids"], batch["attention_mask"],
                                                          batch["finish_reason"])]


def test_multi_turn_batch_layout_and_prefix_reuse(eot_model, tokenizer):
    llm = engine(eot_model)
    batch = sample_agent(llm, rows(4), FixedTurns, ROLLOUT, LIMITS, tokenizer, pad_id=0, mesh=None)
    assert len(batch) == 8 and batch.meta["n"] == 2
    assert batch["answer"] == ["0", "0", "2", "2", "4", "4", "6", "6"]
    assert (batch["turns"] > 1).all(), batch["finish_reason"]
    mask, real = batch["response_mask"], batch["attention_mask"][:, -batch["response_mask"].shape[1]:]
    assert ((mask == 1) <= (real == 1)).all() and (mask < real).any(), "observations are real but masked"
    assert (batch["rollout_log_probs"][mask == 0] == 0).all() and (batch["rollout_log_probs"][mask == 1] <= 0).all()
    # the model's turns as sampled: every turn but a cut one ends with EOS, which the mask keeps
    done = [f == "done" for f in batch["finish_reason"]]
    assert any(done) and (batch["trajectory_reward"][torch.tensor(done)] == 1).all()
    for i, text in enumerate(batch["model_text"]):
        model_ids = batch["responses"][i][mask[i] == 1].tolist()
        assert tokenizer.decode([t for t in model_ids if t != EOS]) == text
    m = agent_rollout_metrics(batch)
    print({k: round(v, 3) for k, v in m.items()})
    assert m["agent/turns"] > 1 and m["agent/observation_tokens"] > 0
    # (5) each later turn's prompt is the whole stream: only its new tail is computed
    assert m["agent/prefill_reused_fraction"] > 0.5, m
    assert (batch["prefill_tokens"] < batch["prompt_tokens"]).all()
    # at most each token once, plus the partial last block of every turn (block_size 4) recomputed
    stream = batch["attention_mask"].sum(1)
    assert (batch["prefill_tokens"] <= stream + 4 * batch["turns"]).all()
    uncached = sample_agent(engine(eot_model, enable_prefix_caching=False), rows(4), FixedTurns, ROLLOUT, LIMITS,
                            tokenizer, 0, None)
    assert trajectories(uncached) == trajectories(batch)
    assert agent_rollout_metrics(uncached)["agent/prefill_reused_fraction"] == 0.0


def test_same_seed_same_trajectories_whatever_the_sharding(eot_model, tokenizer):
    """What ranks see: the whole batch on one engine vs. two halves with their row offsets (as
    dispatch cuts it for 2 ranks), each half on a fresh engine."""
    whole = sample_agent(engine(eot_model), rows(4), FixedTurns, ROLLOUT, LIMITS, tokenizer, 0, None)
    halves = [sample_agent(engine(eot_model), rows(4)[2 * d:2 * d + 2], FixedTurns, ROLLOUT, LIMITS, tokenizer,
                           0, None, row_offset=2 * d) for d in range(2)]
    assert trajectories(whole) == trajectories(halves[0]) + trajectories(halves[1])
    for i, h in enumerate(halves):
        w = whole[4 * i:4 * i + 4]
        R = min(w["response_mask"].shape[1], h["response_mask"].shape[1])
        # the tokens are the same; log-probs up to fp32 rounding, as other batch shapes sum differently
        torch.testing.assert_close(w["rollout_log_probs"][:, :R], h["rollout_log_probs"][:, :R], atol=1e-5, rtol=0)
    other = sample_agent(engine(eot_model), rows(4), FixedTurns, RolloutConfig(n=2, seed=8, progress=False), LIMITS,
                         tokenizer, 0, None)
    assert trajectories(other) != trajectories(whole)


def test_a_hung_step_holds_up_nobody(eot_model, tokenizer):
    limits = AgentLimits(max_turns=6, max_response_tokens=160, max_turn_tokens=32, tool_timeout_s=1.0,
                         step_timeout_s=3.0)
    batch_rows = Batch({"prompt": ["hang on", "go 1", "go 2", "go 3"]})
    start = time.monotonic()
    batch = sample_agent(engine(eot_model), batch_rows, OneHangs, RolloutConfig(n=1, seed=1, progress=False),
                         limits, tokenizer, 0, None)
    wall = time.monotonic() - start
    print(f"wall {wall:.1f}s", batch["finish_reason"])
    assert batch["finish_reason"][0] == "env_timeout" and batch["failed"][0] and batch["trajectory_reward"][0] == 0
    assert all(f != "env_timeout" for f in batch["finish_reason"][1:]) and (batch["turns"][1:] > 1).all()
    assert len(OneHangs.ended) == 3 and max(OneHangs.ended) - start < 3.0, "the others end within the timeout"
    assert wall < 3.0 + 20, wall   # the timeout plus the others' decoding, not 60 s


class FailsAtReset(FixedTurns):
    def reset(self, row):
        if "broken" in row["prompt"]:
            raise RuntimeError("no such task")
        return super().reset(row)


def test_calculator_on_hflow_prompt_rows_and_a_failed_reset(eot_model, tokenizer):
    """The built-in calculator environment (tags format, so TextRenderer) on rows as
    text_batches.prompt_batch makes them (ids, ground truth, extra): the prompt is decoded for the
    environment and the other columns are carried n times. A random model makes no well-formed
    call, so each trajectory is one turn, its final answer. A reset that raises keeps its row
    (its prompt, one masked pad token, reward 0)."""
    ids = [tokenizer.encode(f"{a}*{b}=") for a, b in ((27, 82), (3, 4))]
    prompt_rows = Batch({"prompt_ids": ids, "ground_truth": ["2214", "12"], "extra": [{"level": 1}, {"level": 2}]})
    batch = sample_agent(engine(eot_model), prompt_rows, "calculator", ROLLOUT, LIMITS, tokenizer, 0, None)
    assert batch["ground_truth"] == ["2214", "2214", "12", "12"] and batch["extra"][2] == {"level": 2}
    assert batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()[:len(ids[0])] == ids[0]
    assert all(f in ("done", "max_turn_tokens") for f in batch["finish_reason"]), batch["finish_reason"]
    assert (batch["turns"] == 1).all() and (batch["tool_calls"] == 0).all()

    broken = sample_agent(engine(eot_model), Batch({"prompt": ["broken task", "fine task"]}), FailsAtReset,
                          RolloutConfig(n=1, seed=3, progress=False), LIMITS, tokenizer, 0, None)
    assert broken["finish_reason"][0] == "env_error" and "no such task" in broken["agent_error"][0]
    assert broken["response_mask"][0].sum() == 0 and broken["trajectory_reward"][0] == 0
    assert broken["finish_reason"][1] == "done" and broken["turns"][1] == 4


def forward_log_probs(model, batch):
    """The actor's forward (Actor._log_probs): packed real tokens, log-probs of the responses."""
    tensors = {k: batch[k] for k in ("input_ids", "attention_mask", "responses", "response_mask")}
    packed = packing.pack(tensors)
    out = model(**packed.model_inputs(), logits_to_keep=packed.predict_at)
    logp, _ = token_log_probs(out.logits.squeeze(0), packed.targets, 1.0, False)
    return packed.unpack(logp)


def test_rollout_log_probs_equal_the_forward_and_masked_positions_carry_no_gradient(eot_model, tokenizer):
    from transformers import AutoModelForCausalLM
    from hflow.algos import policy_loss
    batch = sample_agent(engine(eot_model), rows(3), FixedTurns, ROLLOUT, LIMITS, tokenizer, 0, None)
    # as hf_model.build_model loads the actor: packed sequences need hflow's attention
    model = AutoModelForCausalLM.from_pretrained(eot_model, dtype=torch.float32,
                                                 attn_implementation=packing.register_attention())
    mask = batch["response_mask"]
    logp = forward_log_probs(model, batch)
    # (1) fp32 engine vs. training forward, at the model's tokens
    diff = (logp.detach() - batch["rollout_log_probs"]).abs()[mask == 1]
    print(f"max |engine - forward| log-prob {diff.max():.2e} over {int(mask.sum())} model tokens")
    assert diff.max() < 1e-4

    # (2) the loss reads log-probs only under the mask: whatever the log-probs predicted for the
    # observation tokens (here: shifted and scaled) and whatever stands as old log-probs there,
    # the loss and every parameter's gradient are the same
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))

    def grads(perturb):
        model.zero_grad()
        logp = forward_log_probs(model, batch)
        old = batch["rollout_log_probs"].clone()
        if perturb:
            obs = mask == 0
            logp = torch.where(obs, 3 * logp - 5, logp)
            old = torch.where(obs, torch.full_like(old, -30.0), old)
        loss, _ = policy_loss(logp, old, advantages, mask)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    (l0, g0), (l1, g1) = grads(False), grads(True)
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert any(a.abs().sum() > 0 for a in g0)


RANKS_PROGRAM = '''
import json, sys
import torch
import hflow
from hflow.agents import AgentLimits, Environment, StepResult
from hflow.batch import Batch
from hflow.workers import Actor, ActorConfig, RolloutConfig
from hflow.agents import agent_rollout_metrics

path, out = sys.argv[1], sys.argv[2]


class FixedTurns(Environment):   # in __main__ on every rank, so the spec pickles
    def reset(self, row):
        self.left = 4
        return row["prompt"]

    def step(self, text):
        self.left -= 1
        return StepResult(None, 1.0, True) if self.left == 0 else StepResult(f" observation {self.left}")


def main(cluster, _):
    actor = cluster.spawn(Actor, ActorConfig(model_path=path))
    rows = Batch({"prompt": [f"what is {i} plus {i}?" for i in range(4)]})
    rollout = RolloutConfig(n=2, seed=7, progress=False, kv_cache_bytes=64 << 20, block_size=4)
    limits = AgentLimits(max_turns=6, max_response_tokens=160, max_turn_tokens=32)
    if len(actor.ranks) == 1:   # the one-call form; on 2 ranks the three calls
        batch = actor.generate_agent(rows, FixedTurns, rollout, limits)
    else:
        actor.begin_rollout(rollout)
        batch = actor.sample_agent(rows, FixedTurns, rollout, limits)
        actor.end_rollout()
    logp = actor.log_probs(batch)["old_log_probs"]
    mask = batch["response_mask"]
    real = batch["attention_mask"].bool()
    json.dump({"trajectories": [r[m].tolist() for r, m in zip(batch["input_ids"], real)],
               "finish": batch["finish_reason"],
               "max_diff": float(((logp - batch["rollout_log_probs"]).abs() * mask).max()),
               "model_tokens": int(mask.sum()), "metrics": agent_rollout_metrics(batch)}, open(out, "w"))


if __name__ == "__main__":
    hflow.launch(main)
'''


@pytest.mark.dist
def test_actor_agent_rollout_same_on_1_and_2_ranks(eot_model, tmp_path):
    """Actor.generate_agent on 1 rank, sample_agent between begin_rollout and end_rollout on 2:
    the same trajectories, and actor.log_probs equals the engine's log-probs at the model's
    tokens (fp32)."""
    import json
    from dist import torchrun
    results = []
    for world in (1, 2):
        out = tmp_path / f"agent_{world}.json"
        torchrun(RANKS_PROGRAM, world, [eot_model, out], tmp_path=tmp_path, timeout=300,
                 env={"HFLOW_DEVICE": "cpu"}).check()
        results.append(json.loads(out.read_text()))
        print(world, "ranks:", results[-1]["max_diff"], results[-1]["metrics"])
    one, two = results
    assert one["trajectories"] == two["trajectories"] and one["finish"] == two["finish"]
    assert max(len(t) for t in one["trajectories"]) > 40 and one["metrics"]["agent/turns"] > 1
    for r in results:
        assert r["max_diff"] < 1e-4, r


def test_response_texts_and_stop_fraction_count_the_models_tokens_only():
    """A multi-turn row's observations sit between its model turns: the text a reward reads is
    the model's tokens (it used to be the first response_mask.sum() tokens of the stream)."""
    from hflow.recipe_kit.set_up import step_metrics
    from hflow.recipe_kit.text_batches import response_texts

    class Ids:   # a tokenizer whose "text" is the ids it was given
        def batch_decode(self, ids, skip_special_tokens=True):
            return [" ".join(map(str, row)) for row in ids]
    batch = Batch({"responses": torch.tensor([[5, 6, 7, 8, 9, 0], [3, 4, 0, 0, 0, 0]]),
                   "response_mask": torch.tensor([[1., 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0]]),
                   "finish_reason": ["done", "max_turns"]})
    assert response_texts(batch, Ids()) == ["5 6 9", "3 4"]
    metrics = step_metrics(batch, {"time/step_s": 1.0})
    assert metrics["response/stop_fraction"] == 0.5 and metrics["response_length/mean"] == 2.5


def test_a_chat_prompt_is_rendered_once_and_a_text_prompt_as_it_is(eot_model, tokenizer, tmp_path):
    """--data.chat (with a system prompt) and the calculator's tags format: a trajectory begins
    with the data layer's own prompt ids, the template applied once with its special tokens (the
    ids were once decoded for the environment, which dropped the specials, and rendered again);
    a plain-text prompt's ids are the data layer's too."""
    import json

    from hflow.data import DataConfig, load_prompts
    from hflow.recipe_kit.text_batches import agent_prompt_batch
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in (("27*82=", "2214"), ("3*4=", "12"))))
    for chat, system in ((True, "use <calc>"), (False, "")):
        data = load_prompts(DataConfig(train_files=[str(path)], chat=chat, system_prompt=system), tokenizer)
        prompts = [data[i] for i in range(len(data))]
        assert (prompts[0].messages is not None) == chat
        batch = sample_agent(engine(eot_model), agent_prompt_batch(prompts), "calculator",
                             RolloutConfig(n=2, seed=3, progress=False), LIMITS, tokenizer, 0, None)
        assert "prompt" not in batch.keys()   # the prompt itself is input_ids, not a carried column
        for k in range(len(batch)):
            ids = batch["input_ids"][k][batch["attention_mask"][k].bool()].tolist()
            assert ids[:len(prompts[k // 2].prompt_ids)] == prompts[k // 2].prompt_ids, (chat, k)


def test_a_rollouts_figures_count_each_way_trajectories_failed():
    """agent/failures/<reason>: how many trajectories of the batch ended by each failure (the known
    ones always, at 0 when none did; an environment's own AgentFailure reason when it happens),
    and how many answers the reward function failed on (reward_fn)."""
    from hflow.agents import Segment, Trajectory, trajectory_columns, trajectory_tensors

    def ended(reason, failed=None, reward_errors=0):
        t = Trajectory([5, 6], [Segment([7, EOS], [-0.1, -0.2])])
        t.finish(reason, None if reason == "done" else f"{reason} happened", failed)
        t.counts["reward_errors"] = reward_errors
        return t
    trajs = [ended("done"), ended("done", reward_errors=1), ended("env_timeout"), ended("tool_crash"),
             ended("tool_crash"), ended("judge_down", failed=True), ended("max_turns")]
    batch = Batch({**trajectory_tensors(trajs, pad_id=0), **trajectory_columns(trajs),
                   "prompt_tokens": torch.zeros(len(trajs), dtype=torch.long)})
    metrics = agent_rollout_metrics(batch)
    assert {k: v for k, v in metrics.items() if k.startswith("agent/failures/")} == {
        "agent/failures/env_error": 0, "agent/failures/env_timeout": 1, "agent/failures/tool_error": 0,
        "agent/failures/tool_timeout": 0, "agent/failures/tool_crash": 2, "agent/failures/bad_tool_call": 0,
        "agent/failures/judge_down": 1, "agent/failures/reward_fn": 1}
    assert metrics["agent/failed"] == pytest.approx(4 / 7) and metrics["agent/finish/tool_crash"] == pytest.approx(2 / 7)


def test_environment_failures_name_what_failed_and_leave_the_policys_own_zeros():
    """What rewards.record is told per trajectory: the failure that ended it with its error, the
    reward function failing on the answer, or None for a 0 that is the policy's (out of turns)."""
    from hflow.agents import environment_failures

    batch = Batch({"finish_reason": ["env_timeout", "max_turns", "answer", "tool_crash"],
                   "agent_error": ["step took 3 s", "", "", "worker died"],
                   "failed": torch.tensor([True, False, False, True]), "reward_errors": torch.tensor([0, 0, 1, 0])})
    assert environment_failures(batch) == ["env_timeout: step took 3 s", None,
                                           "the reward function failed on its final answer", "tool_crash: worker died"]
