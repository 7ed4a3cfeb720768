"""The planner's prices of asynchronous steps (hflow.planner.asynchronous): each split's parts are
the synchronous planner's own, put together as the pipeline runs them."""
import dataclasses

from hflow.planner.__main__ import main
from hflow.planner.asynchronous import async_plans, rollout_generation
from hflow.planner.fsdp import FSDPPlanner
from hflow.planner.hardware import PROFILES
from hflow.planner.models import Workload, dataflow, model_shape
from hflow.planner.search import Planner, shared_stage_time


def grpo_planner(cls=Planner, devices=8, **hw):
    flow = dataflow("grpo", {"actor": model_shape("7B"), "ref": None, "reward": None}, require=False)
    return cls(flow, Workload(64, 512, 4096, 8, 1, 4096), dataclasses.replace(PROFILES["h100"], **hw), devices)


def test_each_split_adds_up_the_synchronous_planners_own_parts():
    planner = grpo_planner(FSDPPlanner)
    plans = async_plans(planner)
    assert plans and [p.overlapped for p in plans] == sorted(p.overlapped for p in plans)
    for p in plans:
        assert p.rollout_devices + p.train_devices == 8
        # the training group: every model colocated on its devices, less the actor's own generation
        colocated = planner.set_plan(("actor",), p.train_devices)
        actor = colocated.models[0]
        own = actor.details["generate"]["prefill"] + actor.details["generate"]["decode"] + actor.details["reshard"]
        assert abs(p.train - (sum(colocated.stage_times) - own)) < 1e-9
        assert abs(p.generate - rollout_generation(planner, "actor", 1, p.rollout_devices)[0]) < 1e-9
        assert p.sync == p.generate + p.push + p.train
        assert p.overlapped == max(p.generate, p.train + p.push) <= p.sync
    # 7B in bf16 over NVLink (~450 GB/s): ~14 GB a push, a few hundredths of a second
    assert 0.01 < plans[0].push < 0.2


def test_on_a_shared_cpu_the_overlapping_groups_share_its_cores():
    planner = grpo_planner(devices=4, cores=2, devices_per_node=4)
    plans = async_plans(planner)
    assert plans
    for p in plans:
        both = shared_stage_time([(p.rollout_devices, p.generate), (p.train_devices, p.train + p.push)], 2)
        assert abs(p.overlapped - both) < 1e-9
        assert p.overlapped >= max(p.generate, p.train + p.push)


def test_the_cli_prices_asynchronous_splits_and_says_whether_one_beats_the_chosen(capsys):
    assert main(["plan", "--gpus", "8", "--gpu", "h100", "--actor", "7B", "--algo", "grpo", "--reference", "none",
                 "--reward", "none", "--batch", "64", "--samples", "8", "--prompt-len", "512", "--response-len",
                 "4096", "--layouts", "hflow", "--async"]) == 0
    out = capsys.readouterr().out
    assert "asynchronous steps" in out and "rollout 4 | training 4" in out
    assert "the fastest asynchronous split" in out and ("does not beat" in out or " beats " in out)
