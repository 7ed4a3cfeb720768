"""hflow.planner: HybridFlow's automatic mapping (the paper's Algorithm 1 and 2) and its simulator.

    flow = dataflow("ppo", {role: model_shape("13B") for role in ("actor", "critic", "ref", "reward")})
    plans = Planner(flow, Workload(1024, 1024, 1024), PROFILES["a100"], 128).plan()   # fastest first
    plans[0].placement()                                  # role -> ranks
    FSDPPlanner(flow, Workload(32, 16, 5, samples=4), cpu_profile(4), 4).plan()   # hflow's layouts

- search.py: Algorithm 1 (set partitions, device allocations, auto_parallel) and its Plan.
- simulator.py: seconds and bytes of one model's work under a Megatron (p, t, d).
- fsdp.py: the same for hflow's own layouts (FSDP2 training, the engine's tp x dp).
- hardware.py: GPU profiles from published specs; this CPU measured (`cpu_profile`).
- models.py: model shapes (7B-70B or a config.json), each algorithm's roles and dataflow.

`python -m hflow.planner plan ...` prints the best placement for a cluster. The planner knows
nothing of a run: `--trainer.placement auto` (hflow.placement.auto) builds its inputs from a
recipe's config and turns its answer into a Placement.
"""
from hflow.planner.fsdp import FSDPPlanner
from hflow.planner.hardware import PROFILES, Hardware, cpu_profile
from hflow.planner.models import ModelShape, Workload, dataflow, model_shape
from hflow.planner.search import Plan, Planner

__all__ = ["FSDPPlanner", "PROFILES", "Hardware", "cpu_profile", "ModelShape", "Workload", "dataflow",
           "model_shape", "Plan", "Planner"]
