"""--trainer.placement: the SPEC parser and every error, the named placements, the simulator of
hflow's own layouts (FSDP2, the engine, ranks sharing CPU cores) against hand calculations,
and `auto` on 4 CPU ranks with this machine's measured profile."""
import dataclasses
import re
from types import SimpleNamespace

import pytest

from hflow.recipe_kit.config import ActorConfig, DataConfig, RolloutConfig
from hflow.placement import Job, Placement, job_of, resolve
from hflow.placement.auto import candidates
from hflow.planner.fsdp import (
    FSDPPlanner, collective_time, fsdp_infer_time, fsdp_reshard_bytes, fsdp_reshard_time, fsdp_state_bytes,
    fsdp_train_time, fsdp_working_bytes, micro_batches, parameter_tensors)
from hflow.planner.hardware import Efficiency, Hardware, runnable_others
from hflow.planner.models import Model, ModelShape, Workload, dataflow
from hflow.planner.search import SetPlan, kind, set_partitions, shared_stage_time, step_cost
from hflow.planner.simulator import Parallel, forward_flops, generate_time

PPO = [["actor", "ref"], ["critic"]]
PPO_RM = [["actor", "ref"], ["critic", "reward"]]


# -- the parser: table-driven ---------------------------------------------------------------------

@pytest.mark.parametrize("spec, sets, world, expected", [
    ("colocate", PPO, 4, {"actor": [0, 1, 2, 3], "ref": [0, 1, 2, 3], "critic": [0, 1, 2, 3]}),
    ("split", PPO, 4, {"actor": [0, 1], "ref": [0, 1], "critic": [2, 3]}),
    ("split", PPO, 3, {"actor": [0, 1], "ref": [0, 1], "critic": [2]}),
    ("standalone", PPO, 4, {"actor": [0, 1], "ref": [2], "critic": [3]}),         # the extra rank: the actor
    ("standalone", PPO_RM, 4, {"actor": [0], "ref": [1], "critic": [2], "reward": [3]}),
    ("standalone", [["actor"], ["ref"]], 4, {"actor": [0, 1], "ref": [2, 3]}),     # GRPO: split is standalone
    ("split", [["actor"], []], 2, {"actor": [0, 1]}),                              # GRPO, beta 0: one set
    ("actor,ref:0-1;critic:2;reward:3", PPO_RM, 4, {"actor": [0, 1], "ref": [0, 1], "critic": [2], "reward": [3]}),
    (" actor , ref : 0,1 ; critic,reward : 2-3 ", PPO_RM, 4,
     {"actor": [0, 1], "ref": [0, 1], "critic": [2, 3], "reward": [2, 3]}),
    ("critic:3;actor,ref:2,0-1", PPO, 4, {"actor": [0, 1, 2], "ref": [0, 1, 2], "critic": [3]}),   # any order
    ("actor:0-2;ref,critic:3", PPO, 4, {"actor": [0, 1, 2], "ref": [3], "critic": [3]}),
    ("actor,ref,critic:0-3", PPO, 4, {"actor": [0, 1, 2, 3], "ref": [0, 1, 2, 3], "critic": [0, 1, 2, 3]}),
])
def test_placements(spec, sets, world, expected):
    plan = resolve(spec, sets, world, algo="ppo")
    assert isinstance(plan, Placement) and plan == expected
    assert list(plan) == [r for s in sets for r in s]           # the recipe's role order


@pytest.mark.parametrize("spec, world, message", [
    ("splitt", 4, "'splitt': unknown placement; choose colocate, split, standalone, auto, or a SPEC of colocated "
                  "sets with their ranks, e.g. actor,ref:0-1;critic:2-3"),
    ("", 4, "unknown placement"),
    ("actor,ref:0-1;critic:1-3", 4, "sets 'actor,ref:0-1' and 'critic:1-3' overlap on rank 1; roles that share "
                                    "ranks go in one set, e.g. actor,ref,critic:0-3"),
    ("actor,ref:0-1;critc:2-3", 4, "unknown role 'critc' in set 'critc:2-3'; this run's roles are actor, ref, critic"),
    ("actor,ref:0-1;critic,reward:2-3", 4, "unknown role 'reward'"),          # not in this run
    ("actor:0-1;critic:2-3", 4, "no set holds ref; every role of this run needs ranks: add it to a set "
                                "(e.g. actor,ref:0-1)"),
    ("actor:0;critic:1", 4, "no set holds ref"),
    ("actor,ref:0-1;critic:2-4", 4, "set 'critic:2-4' names rank 4, but the run has 4 ranks (0-3); launch with "
                                    "--nproc-per-node 5 or use lower ranks"),
    ("actor,ref:0-1;critic:2", 4, "rank 3 holds no role; give every rank to a set, or launch with fewer ranks"),
    ("actor,ref:0;critic:1", 4, "ranks 2-3 hold no role"),
    ("actor,ref:0-1;critic,ref:2-3", 4, "role 'ref' is in two sets"),
    ("actor,ref:0-1;critic", 4, "set 'critic' has no ranks; write it as roles:ranks, e.g. critic:0-1"),
    ("actor,ref:0-1;critic:", 4, "set 'critic:' has no ranks"),
    ("actor,ref:0-1;critic:2-3;", 4, "an empty set (a ';' too many)"),
    ("actor,,ref:0-1;critic:2-3", 4, "set 'actor,,ref:0-1' has an empty role name"),
    ("actor,ref:0-1;critic:x", 4, "set 'critic:x': 'x' is not a rank or a range of ranks (write ranks as 0-1,4)"),
    ("actor,ref:0-1;critic:3-2", 4, "'3-2' is not a range of ranks (write low-high, both >= 0)"),
    ("actor,ref:0-1;critic:-1", 4, "is not a rank or a range"),
    ("actor,ref:0,0-1;critic:2-3", 4, "set 'actor,ref:0,0-1' names a rank twice"),
    ("split", 1, "split puts actor+ref | critic on ranks of their own: it needs at least 2 ranks and the run has 1; "
                 "launch with --nproc-per-node 2 or more, or use colocate"),
    ("standalone", 2, "standalone puts actor | ref | critic on ranks of their own: it needs at least 3 ranks"),
])
def test_bad_specs_say_what_is_wrong_and_the_fix(spec, world, message):
    with pytest.raises(ValueError) as e:
        resolve(spec, PPO, world, algo="ppo")
    assert message in str(e.value) and "--trainer.placement" in str(e.value)


def test_a_role_in_two_of_the_recipes_sets_is_a_bug_of_the_recipe():
    with pytest.raises(ValueError, match="a role appears in two of the sets"):
        resolve("colocate", [["actor", "ref"], ["ref"]], 4, algo="ppo")


def test_auto_without_a_job_says_how_to_make_one():
    with pytest.raises(ValueError, match=re.escape("needs the run's job: resolve(..., job=hflow.placement.job_of(")):
        resolve("auto", PPO, 4, algo="ppo", device_type="cpu")


# -- the simulator of hflow's layouts, term by term ------------------------------------------------

# round numbers, so that every term can be checked by hand (as tests/test_planner.py)
HW = Hardware("toy", memory=1e6, peak_flops=1e12, memory_bandwidth=1e11, nvlink_bandwidth=1e10,
              network_bandwidth=1e9, nvlink_latency=1e-5, network_latency=1e-4, devices_per_node=4,
              efficiency=Efficiency(train=0.5, inference=0.25, generation=0.5, communication=0.5))
TOY = ModelShape("toy", layers=4, hidden=8, ffn=16, heads=2, kv_heads=1, vocab=32)
ACTOR, CRITIC, REF = Model("actor", TOY, True, False), Model("critic", TOY, True, True), Model("ref", TOY, False, False)
PARAMS = 4 * 576 + 9 * 8 + 256 + 256                   # layers, norms, embedding, head: 2904
WORK = Workload(batch=8, prompt_len=6, response_len=2, updates=2, micro_batch_tokens=16)    # 8 tokens a sequence
FORWARD = 45056                                         # one sequence's forward FLOPs (tests/test_planner.py)


def test_collectives_and_micro_batches_by_hand():
    assert TOY.params() == PARAMS and forward_flops(ACTOR, 8) == FORWARD
    assert collective_time(1e6, 1, HW, 5) == 0
    assert collective_time(1e6, 4, HW, 5) == pytest.approx(3 / 4 * 1e6 / 5e9 + 5 * 1e-5)    # inside a node
    assert collective_time(1e6, 8, HW, 1) == pytest.approx(7 / 8 * 1e6 / 5e8 + 1e-4)        # across nodes
    assert micro_batches(2, WORK) == 1 and micro_batches(3, WORK) == 2          # 16 or 24 tokens, 16 a micro-batch
    assert micro_batches(100, Workload(8, 6, 2)) == 1                           # no budget: one
    tied = ModelShape("tied", layers=4, hidden=8, ffn=16, heads=2, kv_heads=1, vocab=32, tied_embeddings=True)
    assert parameter_tensors(ACTOR) == 9 * 4 + 3 and parameter_tensors(Model("actor", tied, True, False)) == 38


def test_fsdp_train_time_by_hand():
    # 2 ranks: 8 sequences / 2 updates / 2 ranks = 2 rows a step, 16 tokens: one micro-batch
    parts = fsdp_train_time(ACTOR, 2, WORK, HW, keep_gathered=True)
    assert parts["compute"] == pytest.approx(3 * FORWARD * 2 * 2 / (1e12 * 0.5))
    assert parts["gather"] == pytest.approx(2 * (1 / 2 * 2 * PARAMS / 5e9 + 5 * 1e-5))          # bf16 weights, 5 units
    assert parts["reduce_scatter"] == pytest.approx(2 * (1 / 2 * 4 * PARAMS / 5e9 + 5 * 1e-5))  # fp32 gradients
    assert parts["optimizer"] == pytest.approx(2 * 28 * PARAMS / 2 / (1e11 * 0.5))
    # freed after the forward (GPUs): gathered again for the backward
    assert fsdp_train_time(ACTOR, 2, WORK, HW, keep_gathered=False)["gather"] == pytest.approx(2 * parts["gather"])
    # 1 rank: 4 rows a step (32 tokens, 2 micro-batches), no collectives
    one = fsdp_train_time(ACTOR, 1, WORK, HW, keep_gathered=True)
    assert one["compute"] == pytest.approx(2 * parts["compute"]) and one["gather"] == one["reduce_scatter"] == 0


def test_fsdp_infer_time_by_hand():
    parts = fsdp_infer_time(REF, 4, WORK, HW, keep_gathered=False, repeat=2)   # 16 rows / 4 ranks = 4, 2 micro
    gather = 3 / 4 * 2 * PARAMS / 5e9 + 5 * 1e-5
    assert parts == pytest.approx({"compute": FORWARD * 4 / (1e12 * 0.25), "gather": 2 * gather})
    assert fsdp_infer_time(REF, 4, WORK, HW, keep_gathered=True, repeat=2)["gather"] == pytest.approx(gather)


def test_fsdp_memory_by_hand():
    assert fsdp_state_bytes(ACTOR, 4) == 16 * PARAMS / 4                # fp32 weight, gradient, m, v
    assert fsdp_state_bytes(REF, 4) == 4 * PARAMS / 4
    assert fsdp_working_bytes(REF, 4, WORK, 2, keep_gathered=True) == 2 * PARAMS
    # freed after use: two units, the largest a layer (576 weights + 2 norms of 8; the embedding: 256)
    assert fsdp_working_bytes(REF, 4, WORK, 2, keep_gathered=False) == 2 * 2 * 592
    # 2 rows a rank and step, one micro-batch of 16 tokens: 34 s h L bytes (bf16) + fp32 logits
    activations = 34 * 16 * 8 * 4 + 4 * 16 * 32
    assert fsdp_working_bytes(ACTOR, 2, WORK, 2, keep_gathered=True) == 2 * PARAMS + activations
    assert fsdp_working_bytes(CRITIC, 2, WORK, 2, keep_gathered=True) == 2 * CRITIC.shape.params(True) + \
        34 * 16 * 8 * 4 + 4 * 16


def test_fsdp_reshard_by_hand():
    # training shard 1/4, engine shard 1/2 (tp 2) or the whole model (tp 1)
    assert fsdp_reshard_bytes(ACTOR, 4, 2, 2) == pytest.approx(2 * PARAMS * (1 / 2 - 1 / 4))
    assert fsdp_reshard_bytes(ACTOR, 4, 1, 2) == pytest.approx(2 * PARAMS * 3 / 4)
    assert fsdp_reshard_time(ACTOR, 4, 1, HW) == pytest.approx(2 * PARAMS * 3 / 4 / 5e9 + 39 * 1e-5)
    assert fsdp_reshard_time(ACTOR, 2, 2, HW) == 0


def test_ranks_sharing_cores_by_hand():
    assert shared_stage_time([(4, 1.0)], cores=2) == pytest.approx(2.0)           # 4 ranks, 2 cores: half speed
    assert shared_stage_time([(2, 1.0)], cores=2) == pytest.approx(1.0)
    # 3 ranks on 2 cores at 2/3 speed until the 2-rank set is done (0.3 s of work), then 1 alone
    assert shared_stage_time([(2, 0.3), (1, 0.5)], cores=2) == pytest.approx(0.3 * 3 / 2 + 0.2)
    # 8 processes of others: 3 ranks at 2/11, then 1 at 2/9
    assert shared_stage_time([(2, 0.3), (1, 0.5)], cores=2, background=8) == pytest.approx(0.3 * 11 / 2 + 0.2 * 9 / 2)
    assert shared_stage_time([(2, 0.0), (1, 0.0)], cores=2) == 0
    a = SetPlan(("actor",), 2, (), (0.3, 1.0), 0)
    b = SetPlan(("critic",), 1, (), (0.5, 0.0), 0)
    assert step_cost([a, b], cores=2) == pytest.approx((0.65, 1.0))
    assert step_cost([a, b]) == (0.5, 1.0)                                          # GPUs: each its own


# -- the planner over hflow's layouts ---------------------------------------------------------------

CPU_HW = Hardware("cpu", memory=2 ** 30, peak_flops=1e11, memory_bandwidth=1e10, nvlink_bandwidth=2e8,
                  network_bandwidth=2e8, nvlink_latency=1e-4, network_latency=1e-4, devices_per_node=4,
                  weight_bytes=4, cores=2)
DEFAULT = ModelShape("default", layers=4, hidden=256, ffn=1024, heads=4, kv_heads=2, vocab=512, tied_embeddings=True)


def ppo_planner(hw=CPU_HW, work=Workload(32, 6, 5, samples=4, updates=1, micro_batch_tokens=8192)):
    flow = dataflow("ppo", {"actor": DEFAULT, "ref": DEFAULT, "critic": DEFAULT, "reward": None}, require=False,
                    actor_log_probs=False)
    return FSDPPlanner(flow, work, hw, 4)


@pytest.mark.parametrize("memory, replicated", [(2 ** 30, (True, True, True)), (120e6, (False, True, False))])
def test_the_planner_prices_hflows_runs_by_hand(memory, replicated):
    """On CPU a model whose copies fit in a quarter of the memory is replicated on its ranks (hflow's
    default there: no gathers, no resharding, gradients all-reduced), else sharded: with 120 MB
    a rank, the trained actor and critic (16 bytes a parameter) are sharded, the frozen
    reference (4 bytes) replicated."""
    hw = dataclasses.replace(CPU_HW, memory=memory)
    planner = ppo_planner(hw)
    keep = True                                                            # CPU: weights stay gathered
    plan = planner.price([("actor", "ref", "critic")], [4])               # colocate: 4 ranks on 2 cores
    work, (actor, ref, critic) = planner.work, (planner.flow.models[r] for r in ("actor", "ref", "critic"))
    assert tuple(planner.replicated(m) for m in (actor, ref, critic)) == replicated
    replicated_actor, replicated_ref, replicated_critic = replicated
    reshard = 0.0 if replicated_actor else fsdp_reshard_time(actor, 4, 1, hw)
    generation = generate_time(actor, Parallel(1, 1, 4), work, hw, 32)   # 128 sequences, 32 a rank
    generation = generation["prefill"] + generation["decode"] + reshard
    preparation = sum(fsdp_infer_time(ref, 4, work, hw, keep, replicated=replicated_ref).values()) + \
        sum(fsdp_infer_time(critic, 4, work, hw, keep, replicated=replicated_critic).values())
    training = sum(fsdp_train_time(actor, 4, work, hw, keep, replicated_actor).values()) + \
        sum(fsdp_train_time(critic, 4, work, hw, keep, replicated_critic).values())
    assert plan.stage_times == pytest.approx((2 * generation, 2 * preparation, 2 * training))
    assert plan.sets[0].memory >= sum(fsdp_state_bytes(m, 4, r) for m, r in zip((actor, ref, critic), replicated))
    split = planner.price([("actor", "ref"), ("critic",)], [2, 2])
    assert [s.devices for s in split.sets] == [2, 2]
    assert split.stage_times[0] == pytest.approx(sum(
        generate_time(actor, Parallel(1, 1, 2), work, hw, 64)[k] for k in ("prefill", "decode"))
        + (0.0 if replicated_actor else fsdp_reshard_time(actor, 2, 1, hw)))   # 2 ranks busy: each has a core


def test_replicated_training_by_hand():
    """Replicated: no gathers, the fp32 gradients all-reduced (a reduce-scatter's bytes twice),
    Adam over the whole model, the whole state on each rank."""
    sharded = fsdp_train_time(ACTOR, 2, WORK, HW, keep_gathered=True)
    replicated = fsdp_train_time(ACTOR, 2, WORK, HW, keep_gathered=True, replicated=True)
    assert replicated["gather"] == 0 and replicated["compute"] == sharded["compute"]
    assert replicated["reduce_scatter"] == pytest.approx(2 * sharded["reduce_scatter"])
    assert replicated["optimizer"] == pytest.approx(2 * sharded["optimizer"])
    assert fsdp_infer_time(REF, 4, WORK, HW, keep_gathered=False, replicated=True)["gather"] == 0
    assert fsdp_state_bytes(ACTOR, 4, replicated=True) == 4 * fsdp_state_bytes(ACTOR, 4)


def test_the_planner_enumerates_hflows_placements_on_4_ranks():
    planner = ppo_planner()
    plans = planner.plan()
    assert len(plans) == len(set_partitions(["actor", "ref", "critic"])) == 5
    assert planner.sizes == [1, 2, 3, 4]
    for plan in plans:
        assert sorted(r for ranks in plan.ranks for r in ranks) == [0, 1, 2, 3]
        for s in plan.sets:
            assert all(m.train == Parallel(1, 1, s.devices) for m in s.models)   # FSDP over the set's ranks
    # 3 ranks cannot split a trained model's 128 sequences evenly: hflow refuses, so does the planner
    assert planner.set_plan(("critic",), 3) is None and planner.set_plan(("ref",), 3) is not None


def test_a_tie_goes_to_the_recipes_own_grouping():
    # 2 + 2 ranks busy in every stage but generation: the three 2/2 groupings take the same time
    plans = candidates(ppo_planner(), PPO)
    halves = [p for p in plans if [s.devices for s in p.sets] == [2, 2]]
    assert len(halves) == 3 and halves[0].step_time == pytest.approx(halves[2].step_time, rel=1e-12)
    assert kind(halves[0], PPO) == "split" and plans.index(halves[0]) + 2 == plans.index(halves[2])


def test_generation_tp_must_divide_the_actors_ranks():
    flow = dataflow("grpo", {"actor": DEFAULT, "ref": DEFAULT, "reward": None}, require=False)
    planner = FSDPPlanner(flow, Workload(32, 6, 5, samples=4, updates=1), CPU_HW, 4, generation_tp=2)
    assert planner.set_plan(("actor",), 1) is None
    actor = planner.set_plan(("actor",), 2).models[0]
    assert actor.gen == Parallel(1, 2, 1)


# -- auto --------------------------------------------------------------------------------------------

def test_auto_on_4_cpu_ranks_logs_the_plan_it_chose_and_every_candidate():
    job = Job(DEFAULT, Workload(32, 6, 5, samples=4, updates=1, micro_batch_tokens=8192))
    lines = []
    plan = resolve("auto", PPO, 4, algo="ppo", job=job, device_type="cpu", log=lines.append)
    # one of the enumerated placements: the best allocation of a grouping of the three roles
    planner = ppo_planner()
    enumerated = [p.placement() for partition in set_partitions(list(planner.flow.models))
                  for sizes in planner._allocations([1] * len(partition), 4)
                  if (p := planner.price([tuple(s) for s in partition], sizes)) is not None]
    assert dict(plan) in [dict(p) for p in enumerated] and list(plan) == ["actor", "ref", "critic"]
    text = "\n".join(lines)
    assert lines[0].startswith("placement auto: ppo on 4 x cpu (") and "cores" in lines[0], text
    chosen = re.search(r"chose (.*) on ranks (.*): predicted ([\d.e+-]+) s a step", text)
    assert chosen and float(chosen.group(3)) > 0, text
    candidates = [line for line in lines if re.search(r"\s[\d.e+-]+( {3}<- chosen)?$", line) and "  " in line]
    assert len(candidates) == 5 and sum("<- chosen" in line for line in candidates) == 1, text
    chosen_sets = {frozenset(s.split("+")) for s in chosen.group(1).split(": ")[-1].split(" | ")}
    assert chosen_sets == {frozenset(r for r, ranks in plan.items() if ranks == same) for same in plan.values()}


def test_auto_with_a_rollout_group_prices_every_split_and_takes_the_fastest():
    """An asynchronous run (a rollout set): the training roles colocated on the first ranks, the
    rollout group on the rest, as the fastest overlapped split of hflow.planner.asynchronous."""
    from hflow.planner.asynchronous import async_plans
    from hflow.placement.auto import machine_profile, planner_for

    job = Job(DEFAULT, Workload(32, 6, 5, samples=4, updates=1, micro_batch_tokens=8192))
    lines = []
    plan = resolve("auto", [["actor", "ref"], ["rollout"]], 2, algo="grpo", job=job, device_type="cpu",
                   log=lines.append)
    assert dict(plan) == {"actor": [0], "ref": [0], "rollout": [1]}, lines
    text = "\n".join(lines)
    assert lines[0].startswith("placement auto: asynchronous grpo on 2 x cpu"), text
    assert "chose training on ranks 0, rollout on ranks 1" in text and text.count("<- chosen") == 1, text
    # the candidates are the planner's own splits, fastest first
    plans = async_plans(planner_for([["actor", "ref"]], 4, "grpo", job, machine_profile("cpu", 4)))
    assert plans and [p.overlapped for p in plans] == sorted(p.overlapped for p in plans)
    assert all(p.rollout_devices + p.train_devices == 4 for p in plans)
    with pytest.raises(ValueError, match="needs 2 ranks or more"):
        resolve("auto", [["actor"], ["rollout"]], 1, algo="grpo", job=job, device_type="cpu")


def test_job_of_a_recipe_config():
    cfg = SimpleNamespace(data=DataConfig(batch_size=16), rollout=RolloutConfig(n=4, max_tokens=32, tp_size=2),
                          actor=ActorConfig(epochs=2, mini_batch_size=4, max_tokens_per_micro_batch=4096),
                          algo=SimpleNamespace(old_log_probs="auto"))
    prompts = SimpleNamespace(prompt_ids=[[1] * 10, [1] * 20])
    from hflow.default import default_model_dir
    job = job_of(cfg, str(default_model_dir("tiny")), prompts, actor_log_probs=False)
    assert job.work == Workload(16, 15, 32, samples=4, updates=2 * 4, micro_batch_tokens=4096)
    assert job.generation_tp == 2 and not job.actor_log_probs
    assert job.model.hidden == 64 and job.model.layers == 2 and job.model.tied_embeddings
    assert job_of(cfg, str(default_model_dir("tiny")), prompts, actor_log_probs=True).actor_log_probs
    cfg.actor = ActorConfig(micro_batch_size=8)                              # no token budget: 8 sequences
    assert job_of(cfg, str(default_model_dir("tiny")), prompts, False).work.micro_batch_tokens == 8 * (15 + 32)


def test_runnable_others_counts_processes():
    assert runnable_others(seconds=0.05, samples=5) >= 0


def test_the_cli_plans_hflows_layouts(capsys):
    from hflow.planner.__main__ import main
    assert main("plan --gpus 16 --actor 7B --algo ppo --layouts hflow --micro-batch-tokens 4096".split()) == 0
    out = capsys.readouterr().out
    assert "15 placements fit" in out and "chosen:" in out and "(1,1,8)" in out   # FSDP over a set's 8 GPUs
