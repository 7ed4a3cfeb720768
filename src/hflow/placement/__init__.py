"""Placement: which ranks hold which role.

A plan is a dict role -> list of global ranks, passed to `cluster.spawn(..., ranks=plan[role])`.

    colocate(["actor", "critic", "ref"], 4)            # every role on ranks 0..3 (hybrid engine)
    split([["actor", "ref"], ["critic", "reward"]], 4)  # actor+ref on 0,1; critic+reward on 2,3
    split([["actor", "ref"], ["critic"]], 8, sizes=[6, 2])

Colocated roles take turns on the same ranks (each call runs in controller order); split sets
run concurrently on disjoint ranks. A recipe turns its --trainer.placement flag into a plan with
`resolve` (colocate, split, standalone, auto, or a SPEC like actor,ref:0-1;critic:2-3; see
hflow.placement.spec); `auto` (hflow.placement.auto, with the run's `job_of`) asks the planner,
the paper's Algorithm 1 over hflow's own layouts, which is a package of its own: hflow.planner
(`python -m hflow.planner plan ...`).

- ranks.py: Placement, colocate, split.
- spec.py: --trainer.placement: the named placements, SPEC parsing, `resolve`.
- auto.py: --trainer.placement auto: a run's Job, the machine's profile, the planner's answer.
"""
from hflow.placement.auto import Job, job_of
from hflow.placement.ranks import Placement, colocate, split
from hflow.placement.spec import resolve

__all__ = ["Placement", "colocate", "split", "resolve", "Job", "job_of"]
