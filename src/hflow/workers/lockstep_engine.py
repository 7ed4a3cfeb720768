"""A tensor-parallel engine driven from one of its ranks: the tp group's engines take the same
requests in the same engine steps, while only the group's leader decides what they are.

    group = EngineGroup(llm, gen_mesh)              # hybrid_engine.agent_engine at --rollout.tp-size > 1
    parts = group.gather(my_rows)                   # every member: the leader sees the group's work
    if group.is_leader:
        with group.lead() as engine:                # LockstepEngine: LLM's request surface
            rid = engine.add_request(ids, params, request_id=key)
            while engine.has_unfinished():
                for out in engine.step(): ...       # as LLM.step
        mine = group.scatter(results_per_member)
    else:
        group.follow()                              # replays the leader's operations, step by step
        mine = group.scatter(None)

Every rank of a tensor-parallel group runs the same engine step together (its matmuls are
sharded, its collectives joint), so the ranks must schedule the same sequences at every step.
A multi-turn driver cannot promise that on its own: the next turn of a trajectory is queued when
its tool call answers, and tool calls answer when they answer, on each rank differently. So one
rank leads: it runs every session of the group (environments, tool calls, turn bookkeeping) and
drives a LockstepEngine; before each of its engine steps the proxy broadcasts the operations
queued since the last one (add_request with its ids, params and request id; abort), and the
followers apply them and step too. The schedule is a function of the engine's state and the
operations, the sampled tokens are the same on every rank (logits all-gathered, the same seeds),
so the followers' engines stay in the leader's state without ever being told it; each message
also carries the requests the leader's previous step finished, which a follower checks against
its own, so that a divergence fails at once instead of hanging in a collective.

Between two steps the leader may wait (for tool calls) as long as it likes: the followers wait
in the broadcast, well within the process group's timeout (a step's tool calls are bounded by
--agent.step-timeout-s). When the leader is done it closes the proxy, normally or after a
failure; a follower then returns, or raises so that its rank's call fails with the leader's.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable

import torch.distributed as dist

from hflow.engine import LLM, SamplingParams
from hflow.engine.sequence import RequestOutput

_STEP, _CLOSE, _FAIL = "step", "close", "fail"


class LockstepEngine:
    """The leader's side: LLM's request surface (add_request, step, abort, has_unfinished; the
    read-only attributes max_model_len, eos_token_ids, tokenizer, hf_config pass through), each
    operation applied to the leader's engine at once and sent to the followers with the next step."""

    def __init__(self, llm: LLM, group, leader: int):
        self.llm, self.group, self.leader = llm, group, leader
        self._ops: list[tuple] = []
        self._finished: list[Hashable] = []   # what the last step finished, for the followers' check
        self.closed = False
        self.steps = 0

    def __getattr__(self, name):   # max_model_len, eos_token_ids, tokenizer, hf_config, stats ...
        if name in ("llm", "group", "leader"):
            raise AttributeError(name)
        return getattr(self.llm, name)

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id: Hashable | None = None) -> Hashable:
        self._check_open()
        params = sampling_params or SamplingParams()
        if params.seed is None:
            # the followers must draw what the leader draws: an unseeded request gets one seed for all
            params = dataclasses.replace(params, seed=random.getrandbits(62))
        request_id = self.llm.add_request(prompt_token_ids, params, request_id)
        self._ops.append(("add", list(prompt_token_ids), params, request_id))
        return request_id

    def abort(self, request_id: Hashable) -> None:
        self._check_open()
        self.llm.abort(request_id)
        self._ops.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return self.llm.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Send the operations queued since the last step, then step with the followers."""
        self._check_open()
        if not self.llm.has_unfinished():   # nothing to run: an idle step needs no one
            if self._ops:                   # (aborts of the last requests: applied now)
                self._send(_STEP)
            return []
        self._send(_STEP)
        outputs = self.llm.step()
        self._finished = [o.request_id for o in outputs]
        self.steps += 1
        return outputs

    def close(self, failed: bool = False) -> None:
        """Let the followers go: after the last step, or (failed) after an error, on which each
        follower drops what it holds and raises."""
        if self.closed:
            return
        self.closed = True
        self._send(_FAIL if failed else _CLOSE)

    def __enter__(self) -> "LockstepEngine":
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(failed=kind is not None)

    def _send(self, kind: str) -> None:
        message = [(kind, self._ops, self._finished)]
        self._ops, self._finished = [], []
        if self.group is not None:
            dist.broadcast_object_list(message, src=self.leader, group=self.group)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the lockstep engine was closed: its followers have stopped replaying")


def follow(llm: LLM, group, leader: int) -> int:
    """A follower's side: apply each operation the leader sends and step with it, until it
    closes. Returns the steps taken; raises when the leader failed or the engines diverged."""
    unfinished: set = set()
    finished: list = []
    steps = 0
    try:
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=leader, group=group)
            kind, ops, leader_finished = message[0]
            if kind != _FAIL and leader_finished != finished:
                raise RuntimeError(f"tensor-parallel engines diverged at step {steps}: the leader (rank {leader}) "
                                   f"finished {leader_finished}, this rank {finished}")
            for op in ops:
                if op[0] == "add":
                    _, ids, params, request_id = op
                    llm.add_request(ids, params, request_id)
                    unfinished.add(request_id)
                else:
                    llm.abort(op[1])
                    unfinished.discard(op[1])
            if kind == _FAIL:
                raise RuntimeError(f"the leader of this tensor-parallel engine group (rank {leader}) failed; "
                                   "its own error says why")
            if kind == _CLOSE:
                if unfinished:
                    raise RuntimeError(f"the leader (rank {leader}) closed with requests unfinished here: "
                                       f"{sorted(map(str, unfinished))[:5]}")
                return steps
            finished = [o.request_id for o in llm.step()] if llm.has_unfinished() else []
            unfinished.difference_update(finished)
            steps += 1
    except BaseException:
        for request_id in list(unfinished):   # leave the engine idle for the next rollout
            try:
                llm.abort(request_id)
            except KeyError:
                pass
        raise


class EngineGroup:
    """The engine of one rank of a tensor-parallel group (the tp dim of a generation mesh, as
    hflow.distributed.reshard.generation_mesh builds it) and how the group works as one:
    gather the members' work on the leader, lead or follow, hand the results back."""

    def __init__(self, llm: LLM, gen_mesh):
        self.llm = llm
        self.group = gen_mesh.get_group("tp")
        self.ranks = dist.get_process_group_ranks(self.group)
        self.leader = self.ranks[0]
        self.rank = dist.get_rank()
        self.index = self.ranks.index(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def size(self) -> int:
        return len(self.ranks)

    # the engine's read-only facts, as on an LLM
    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return self.llm.eos_token_ids

    def gather(self, obj) -> list | None:
        """Every member's `obj`, in member order, on the leader (None on the others)."""
        out = [None] * self.size if self.is_leader else None
        dist.gather_object(obj, out, dst=self.leader, group=self.group)
        return out

    def scatter(self, parts: list | None):
        """The leader's parts[i] to member i; each member gets its own."""
        out = [None]
        dist.scatter_object_list(out, parts if self.is_leader else None, src=self.leader, group=self.group)
        return out[0]

    def lead(self) -> LockstepEngine:
        if not self.is_leader:
            raise RuntimeError(f"rank {self.rank} leads no tensor-parallel group: its leader is rank {self.leader}")
        return LockstepEngine(self.llm, self.group, self.leader)

    def follow(self) -> int:
        if self.is_leader:
            raise RuntimeError("the leader of a tensor-parallel group leads (lead()), it does not follow")
        return follow(self.llm, self.group, self.leader)
