"""--trainer.placement: the placement a recipe's flag names.

    sets = [["actor", "ref"], ["critic"]]                 # the recipe's natural split
    resolve("colocate", sets, 4, algo="ppo")             # every role on ranks 0-3
    resolve("split", sets, 4, algo="ppo")                # actor+ref on 0-1, critic on 2-3
    resolve("standalone", sets, 4, algo="ppo")           # actor 0-1, ref 2, critic 3
    resolve("actor,ref:0-1;critic:2-3", sets, 4, algo="ppo")
    resolve("auto", sets, 4, algo="ppo", job=job_of(cfg, model_dir, train, actor_log_probs=False))

A SPEC lists colocated sets separated by `;`, each `role,role:ranks`, ranks a comma list of
ranks and ranges (`0-1,4`). Sets must not share a rank, every role of the run must be in one
set, and every rank of the world must hold a role: an idle rank would be a device the run
pays for and never uses (run with fewer ranks instead).
"""
from __future__ import annotations

from typing import Callable, Sequence

from hflow.placement.auto import auto_placement
from hflow.placement.ranks import Placement, colocate, split
from hflow.planner.search import ranks_text
from hflow.validation import ConfigError

FLAG = "--trainer.placement"
NAMED = ("colocate", "split", "standalone", "auto")


def resolve(spec: str, sets: Sequence[Sequence[str]], world_size: int, *, algo: str, job=None,
            device_type: str | None = None, log: Callable[[str], None] = print) -> Placement:
    """The placement `spec` names for a run whose roles are `sets` (as `split` groups them).

    colocate: every role on every rank. split: each of `sets` on ranks of its own (the
    recipe's natural groups: for PPO and Safe-RLHF the actor with the reference, the critics
    with the scorers; for GRPO and ReMax, which have no critic, the actor alone and the frozen
    scorers, reference and reward model, together). standalone: every role on ranks of its
    own, as even as possible, the extra ranks to the roles listed first (the actor: its engine
    generates on them). auto: the fastest placement of `hflow.placement.auto` for `job` on
    this machine, logged with the predicted step time of every candidate. Otherwise a SPEC.
    """
    sets = [list(s) for s in sets if s]
    roles = [role for s in sets for role in s]
    if len(set(roles)) != len(roles):
        raise ConfigError(f"resolve: a role appears in two of the sets {sets}")
    spec = spec.strip()
    if spec == "colocate":
        return colocate(roles, world_size)
    if spec in ("split", "standalone"):
        groups = sets if spec == "split" else [[role] for role in roles]
        if len(groups) > world_size:
            raise ConfigError(f"{FLAG} {spec} puts {' | '.join('+'.join(g) for g in groups)} on ranks of their own: "
                             f"it needs at least {len(groups)} ranks and the run has {world_size}; launch with "
                             f"--nproc-per-node {len(groups)} or more, or use colocate")
        return split(groups, world_size)
    if spec == "auto":
        return auto_placement(sets, world_size, algo=algo, job=job, device_type=device_type, log=log)
    if ":" not in spec:
        raise ConfigError(f"{FLAG} {spec!r}: unknown placement; choose {', '.join(NAMED)}, or a SPEC of "
                         f"colocated sets with their ranks, e.g. {example(sets, world_size)}")
    return parse_spec(spec, roles, world_size)


def example(sets: list[list[str]], world_size: int) -> str:
    """The run's split (or, on too few ranks, colocation) written as a SPEC, for messages."""
    if 1 < len(sets) <= world_size:
        plan = split(sets, world_size)
        return ";".join(f"{','.join(s)}:{ranks_text(plan[s[0]])}" for s in sets)
    return f"{','.join(r for s in sets for r in s)}:{ranks_text(list(range(world_size)))}"


def parse_ranks(text: str, where: str) -> list[int]:
    """`0-1,4` -> [0, 1, 4]."""
    ranks = []
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ConfigError(f"{FLAG}: set {where!r}: {item.strip()!r} is not a rank or a range of ranks "
                             f"(write ranks as 0-1,4)") from None
        if lo < 0 or hi < lo:
            raise ConfigError(f"{FLAG}: set {where!r}: {item.strip()!r} is not a range of ranks (write low-high, "
                             f"both >= 0)")
        ranks += range(lo, hi + 1)
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"{FLAG}: set {where!r} names a rank twice")
    return sorted(ranks)


def parse_spec(spec: str, roles: list[str], world_size: int) -> Placement:
    """`actor,ref:0-1;critic:2;reward:3` -> role -> ranks, every error named with its fix."""
    placed, holder = {}, {}            # role -> ranks; rank -> (the set's text, its roles)
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            raise ConfigError(f"{FLAG} {spec!r}: an empty set (a ';' too many)")
        names, colon, ranks_part = part.partition(":")
        if not colon or not ranks_part.strip():
            raise ConfigError(f"{FLAG}: set {part!r} has no ranks; write it as roles:ranks, e.g. {names.strip()}:0-1")
        set_roles = [name.strip() for name in names.split(",")]
        if "" in set_roles:
            raise ConfigError(f"{FLAG}: set {part!r} has an empty role name; write roles as actor,ref")
        for role in set_roles:
            if role not in roles:
                raise ConfigError(f"{FLAG}: unknown role {role!r} in set {part!r}; this run's roles are "
                                 f"{', '.join(roles)}")
            if role in placed:
                raise ConfigError(f"{FLAG}: role {role!r} is in two sets; a role runs on one set of ranks")
        ranks = parse_ranks(ranks_part, part)
        for rank in ranks:
            if rank >= world_size:
                raise ConfigError(f"{FLAG}: set {part!r} names rank {rank}, but the run has {world_size} ranks "
                                 f"(0-{world_size - 1}); launch with --nproc-per-node {max(ranks) + 1} or use "
                                 f"lower ranks")
            if rank in holder:
                other, other_roles = holder[rank]
                both = sorted(set(placed[other_roles[0]]) | set(ranks))
                raise ConfigError(f"{FLAG}: sets {other!r} and {part!r} overlap on rank {rank}; roles that share "
                                 f"ranks go in one set, e.g. {','.join(other_roles + set_roles)}:{ranks_text(both)}")
            holder[rank] = (part, set_roles)
        placed.update({role: ranks for role in set_roles})
    missing = [role for role in roles if role not in placed]
    if missing:
        first, first_roles = holder[min(holder)]
        raise ConfigError(f"{FLAG}: no set holds {', '.join(missing)}; every role of this run needs ranks: add "
                         f"{'it' if len(missing) == 1 else 'them'} to a set (e.g. "
                         f"{','.join(first_roles + missing)}:{ranks_text(placed[first_roles[0]])})")
    idle = [rank for rank in range(world_size) if rank not in holder]
    if idle:
        raise ConfigError(f"{FLAG}: rank{'s' * (len(idle) > 1)} {ranks_text(idle)} hold{'s' * (len(idle) == 1)} "
                         f"no role; give every rank to a set, or launch with fewer ranks")
    return Placement({role: placed[role] for role in roles})
