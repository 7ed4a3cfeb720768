"""Placement: which ranks hold which role, and the two ways to build one by hand.

    colocate(["actor", "critic", "ref"], 4)            # every role on ranks 0..3 (hybrid engine)
    split([["actor", "ref"], ["critic", "reward"]], 4)  # actor+ref on 0,1; critic+reward on 2,3
    split([["actor", "ref"], ["critic"]], 8, sizes=[6, 2])
"""
from __future__ import annotations

from typing import Sequence


class Placement(dict):
    """role -> ranks. `plan.roles_on(rank)` inverts it."""

    def roles_on(self, rank: int) -> list[str]:
        return [role for role, ranks in self.items() if rank in ranks]

    def __repr__(self):
        return "Placement(" + ", ".join(f"{r}={v}" for r, v in self.items()) + ")"


def colocate(roles: Sequence[str], world_size: int) -> Placement:
    """Every role on every rank."""
    return Placement({role: list(range(world_size)) for role in roles})


def split(role_sets: Sequence[Sequence[str] | str], world_size: int,
          sizes: Sequence[int] | None = None) -> Placement:
    """Disjoint blocks of consecutive ranks, one per set of colocated roles.

    `sizes` gives each set's rank count (default: as even as possible, earlier sets get the
    extra ranks). With fewer ranks than sets, the sets cannot be disjoint: everything falls
    back to colocation, so a recipe written for 8 ranks still runs on 1.
    """
    role_sets = [[s] if isinstance(s, str) else list(s) for s in role_sets]
    all_roles = [role for s in role_sets for role in s]
    if len(set(all_roles)) != len(all_roles):
        raise ValueError(f"split: a role appears in two sets: {role_sets}")
    if world_size < len(role_sets):
        return colocate(all_roles, world_size)
    if sizes is None:
        base, extra = divmod(world_size, len(role_sets))
        sizes = [base + (i < extra) for i in range(len(role_sets))]
    sizes = list(sizes)
    if len(sizes) != len(role_sets) or sum(sizes) != world_size or min(sizes) < 1:
        raise ValueError(f"split: sizes {sizes} must give each of the {len(role_sets)} role "
                         f"sets at least one rank and add up to {world_size}")
    plan, start = Placement(), 0
    for role_set, size in zip(role_sets, sizes):
        for role in role_set:
            plan[role] = list(range(start, start + size))
        start += size
    return plan
