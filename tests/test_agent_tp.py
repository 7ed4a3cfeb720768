"""Multi-turn agents on a tensor-parallel engine (workers/lockstep_engine.py): the tp group's leader
runs the sessions and its followers replay each engine step's requests, so a trajectory is the
same at tp 2 as at tp 1 (same seeds); a leader's failure fails its followers instead of leaving
them waiting, and engines that diverge say so."""
import json

import pytest

from dist import torchrun
from test_agent_rollout import eot_model, tokenizer  # noqa: F401 (fixtures)

LOCKSTEP = '''
import os, sys
import torch
import torch.distributed as dist
from hflow.engine import LLM, SamplingParams
from hflow.workers.lockstep_engine import follow, LockstepEngine

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, path = dist.get_rank(), sys.argv[1]
group = dist.group.WORLD
llm = LLM.from_pretrained(path, tp_group=group, kv_cache_bytes=32 << 20, block_size=4)
reference = LLM.from_pretrained(path, kv_cache_bytes=32 << 20, block_size=4)   # tp 1, this rank alone
prompts = {f"p{i}": list(range(3 + i, 20 + 2 * i)) for i in range(4)}
params = SamplingParams(n=1, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)   # 12 steps each

def lead(fail_at=None):
    """Requests added over several steps (as turns come back from tools), one aborted."""
    out = {}
    with LockstepEngine(llm, group, 0) as engine:
        engine.add_request(prompts["p0"], params, request_id="p0")
        engine.add_request(prompts["p3"], params, request_id="p3")
        steps = 0
        while engine.has_unfinished() or len(out) < 3:
            if steps == 2:
                engine.add_request(prompts["p1"], params, request_id="p1")
                engine.add_request(prompts["p2"], params, request_id="p2")
            if steps == 3:
                engine.abort("p3")   # (in its 4th step of 12)
            if steps == fail_at:
                raise ValueError("the leader's environment broke")
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
            steps += 1
    return out

# 1. lockstep: the leader's outputs are tp 1's
if rank == 0:
    got = lead()
    want = {k: o.outputs[0].token_ids for k, o in zip(["p0", "p1", "p2"],
            reference.generate([prompts["p0"], prompts["p1"], prompts["p2"]], params))}
    assert got == want, (got, want)
else:
    steps = follow(llm, group, 0)
    assert steps > 3 and not llm.has_unfinished(), steps
print(f"rank {rank} lockstep ok", flush=True)

# 2. the leader fails mid-way: the follower raises, its engine idle for the next rollout
if rank == 0:
    try:
        lead(fail_at=4)
        raise AssertionError("no error")
    except ValueError:
        pass
    assert llm.has_unfinished()   # (the driver's own abort is what empties the leader's engine)
    for rid in ("p0", "p1", "p2"):
        try:
            llm.abort(rid)
        except KeyError:
            pass
else:
    try:
        follow(llm, group, 0)
        raise AssertionError("the follower returned")
    except RuntimeError as e:
        assert "failed" in str(e), e
    assert not llm.has_unfinished()
print(f"rank {rank} failure ok", flush=True)

# 3. divergence: a follower whose engine finished something else is told at once
if rank == 0:
    engine = LockstepEngine(llm, group, 0)
    engine.add_request(prompts["p0"], params, request_id="p0")
    while engine.has_unfinished():
        engine.step()
    engine._finished = ["not what you finished"]
    engine.close()
else:
    try:
        follow(llm, group, 0)
        raise AssertionError("no divergence seen")
    except RuntimeError as e:
        assert "diverged" in str(e), e
print(f"rank {rank} divergence ok", flush=True)
dist.barrier()
sys.stdout.flush()
os._exit(0)
'''


@pytest.mark.dist
def test_followers_replay_the_leaders_requests_step_by_step(eot_model, tmp_path):  # noqa: F811
    run = torchrun(LOCKSTEP, 2, [eot_model], tmp_path=tmp_path, timeout=300).check()
    for what in ("lockstep", "failure", "divergence"):
        assert f"rank 0 {what} ok" in run.output and f"rank 1 {what} ok" in run.output, run.output


ACTOR = '''
import json, os, sys
import torch
import hflow
from hflow.agents import AgentLimits, Environment, StepResult, agent_rollout_metrics
from hflow.batch import Batch
from hflow.workers import Actor, ActorConfig, RolloutConfig

path, out = sys.argv[1], sys.argv[2]


class FixedTurns(Environment):   # in __main__ on every rank, so the spec pickles
    def reset(self, row):
        self.left = 4
        return row["prompt"]

    def step(self, text):
        self.left -= 1
        with open(out + ".steps", "a") as f:   # which rank stepped it
            print(torch.distributed.get_rank(), file=f)
        return StepResult(None, 1.0, True) if self.left == 0 else StepResult(f" observation {self.left}")


def main(cluster, _):
    actor = cluster.spawn(Actor, ActorConfig(model_path=path))
    rows = Batch({"prompt": [f"what is {i} plus {i}?" for i in range(6)]})
    limits = AgentLimits(max_turns=6, max_response_tokens=160, max_turn_tokens=32)
    found = {}
    for tp in (1, 2):
        rollout = RolloutConfig(n=2, seed=7, progress=False, kv_cache_bytes=64 << 20, block_size=4, tp_size=tp)
        batch = actor.generate_agent(rows, FixedTurns, rollout, limits)
        logp = actor.log_probs(batch)["old_log_probs"]
        mask = batch["response_mask"]
        real = batch["attention_mask"].bool()
        found[tp] = {"trajectories": [r[m].tolist() for r, m in zip(batch["input_ids"], real)],
                     "finish": batch["finish_reason"], "turns": batch["turns"].tolist(),
                     "max_diff": float(((logp - batch["rollout_log_probs"]).abs() * mask).max()),
                     "metrics": agent_rollout_metrics(batch),
                     "stepped_on": open(out + ".steps").read().split()}
        os.remove(out + ".steps")
    json.dump(found, open(out, "w"))


if __name__ == "__main__":
    hflow.launch(main)
'''


@pytest.mark.dist
def test_agent_trajectories_at_tp_2_are_those_of_tp_1(eot_model, tmp_path):  # noqa: F811
    """The actor on 2 ranks: generate_agent at tp 1 (each rank its own rows) and at tp 2 (rank 0
    leads, running both ranks' sessions; rank 1 follows): the same trajectories, token for
    token, and the engine's log-probs the trainer's at the model's tokens."""
    out = tmp_path / "tp.json"
    torchrun(ACTOR, 2, [eot_model, out], tmp_path=tmp_path, timeout=400, env={"HFLOW_DEVICE": "cpu"}).check()
    found = json.loads(out.read_text())
    one, two = found["1"], found["2"]
    assert one["trajectories"] == two["trajectories"] and one["finish"] == two["finish"]
    assert max(one["turns"]) > 1 and one["metrics"]["agent/turns"] > 1
    # at tp 1 each rank stepped its own rows' environments; at tp 2 the leader stepped them all
    assert set(one["stepped_on"]) == {"0", "1"} and set(two["stepped_on"]) == {"0"}
    assert len(one["stepped_on"]) == len(two["stepped_on"]) == sum(one["turns"])
    for r in (one, two):
        assert r["max_diff"] < 1e-4, r["max_diff"]
    print({k: v for k, v in two["metrics"].items() if not k.startswith("agent/failures")})


ROLLOUT_GROUP = '''
import dataclasses, json, sys
import hflow
from hflow.agents import AgentLimits, Environment, StepResult
from hflow.batch import Batch
from hflow.workers import Actor, ActorConfig, RolloutConfig
from hflow.workers.rollout import Rollout

path, out = sys.argv[1], sys.argv[2]


class FixedTurns(Environment):
    def reset(self, row):
        self.left = 3
        return row["prompt"]

    def step(self, text):
        self.left -= 1
        return StepResult(None, 1.0, True) if self.left == 0 else StepResult(f" observation {self.left}")


def main(cluster, _):
    cfg = ActorConfig(model_path=path)
    actor = cluster.spawn(Actor, cfg, ranks=[0])
    one = RolloutConfig(n=2, seed=11, progress=False, kv_cache_bytes=64 << 20, block_size=4)
    two = dataclasses.replace(one, tp_size=2)
    rollout = cluster.spawn(Rollout, cfg, two, ranks=[1, 2])
    manifest = actor.weight_manifest()   # (before the push, which holds rank 0 until the receive joins it)
    pushed = actor.push_weights.future(rollout.ranks)
    rollout.receive_weights(0, manifest, actor.ranks[0])
    pushed.result()
    rows = Batch({"prompt": [f"what is {i} times {i}?" for i in range(4)]})
    limits = AgentLimits(max_turns=4, max_response_tokens=96, max_turn_tokens=24)
    want = actor.generate_agent(rows, FixedTurns, one, limits)
    got = rollout.generate_agent(rows, FixedTurns, two, limits)
    def streams(b):
        return [r[m].tolist() for r, m in zip(b["input_ids"], b["attention_mask"].bool())]
    json.dump({"same": streams(want) == streams(got), "turns": got["turns"].tolist(),
               "policy_version": got["policy_version"].tolist(),
               "turn_policy_version": got["turn_policy_version"].tolist()}, open(out, "w"))


if __name__ == "__main__":
    hflow.launch(main)
'''


@pytest.mark.dist
def test_a_rollout_group_at_tp_2_runs_the_actors_trajectories_and_records_their_version(eot_model, tmp_path):  # noqa: F811
    """The actor on rank 0 at tp 1, a rollout group on ranks 1-2 at tp 2 (rank 1 leads) fed by a
    push: the same trajectories; every turn by version 0."""
    out = tmp_path / "group.json"
    torchrun(ROLLOUT_GROUP, 3, [eot_model, out], tmp_path=tmp_path, timeout=400, env={"HFLOW_DEVICE": "cpu"}).check()
    found = json.loads(out.read_text())
    assert found["same"] and max(found["turns"]) > 1, found
    assert found["policy_version"] == [0] * 8
    assert all(v == (0 if i < n else -1) for row, n in zip(found["turn_policy_version"], found["turns"])
               for i, v in enumerate(row))
