"""Multi-turn rollouts on an actor rank: many AgentSessions in flight on one engine (issue 24).

    batch = sample_agent(llm, rows, "calculator", rollout, limits, tokenizer, pad_id, mesh)

Every (row, sample) is one session. Each session's first turn is queued at once; whenever the
engine finishes a turn, its environment step (tool calls) goes to a thread (agents.TurnRunner)
and the engine keeps decoding the others; when the step answers, the session's next turn is
queued with the whole stream as its prompt, so the prefix cache supplies the KV of every
full block of the earlier turns. The batch is in hflow.layout's layout with response_mask 1
only on the model's tokens.

Seeds: a turn's seed is derived from (rollout.seed, global row index, sample index, turn), and
the engine mixes the prompt into each stream, so a trajectory does not depend on which rank ran
it or on what was decoded beside it: the same seed gives the same trajectories on any number
of ranks, and at any tensor-parallel size.

Tensor parallel (`llm` an EngineGroup, workers/lockstep_engine.py): the group's engines must
take the same requests in the same steps, so its leader gathers the members' rows, runs every
session of the group on a LockstepEngine (the followers replay its operations and step with
it), and hands each member its own rows' trajectories back.

Policy versions (`version`, a rollout group's: workers/rollout.py): each model turn records the
version that sampled each of its tokens (Segment.policy_versions): the version when the turn was
queued, plus one at each weight load the engine reports within it (a partial rollout's
`between_steps` loads the next version between two engine steps, even while every session waits
for its tools). The batch then says so per row (policy_version: its first model token's),
per token (token_policy_version) and per turn (turn_policy_version [B, max_turns], -1 past the
last turn), so that a trajectory whose turns several policies sampled is seen as such.
"""
from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections import Counter
from typing import Callable, Optional

import torch

from hflow.agents import (AgentLimits, AgentSession, ChatRenderer, Environment, Segment, TextRenderer,
                          Trajectory, TurnRunner, trajectory_columns, trajectory_tensors)
from hflow.agents.endpoint.agent_function import is_agent_function
from hflow.agents.registry import EnvSpec, environment_factory
from hflow.agents.trajectory import MAX_TOKENS
from hflow.batch import Batch
from hflow.engine import LLM, SamplingParams
from hflow.workers.lockstep_engine import EngineGroup
from hflow.workers.rollout_batches import OFFER_POLL_S, RolloutConfig, group_max, turn_seed

# columns a prompts Batch carries that are the prompt itself, not a row's data
_PROMPT_COLUMNS = ("prompt", "prompt_ids", "input_ids", "attention_mask")


def pick_renderer(tokenizer, env: Environment, prompt=None):
    """The chat template for a prompt given as chat messages (rendered here, once) and, when the
    tokenizer has one, for the formats whose results are the template's own tool messages
    (hermes); plain text otherwise, and for the tags format on a text prompt, whose results
    TextRenderer wraps itself (a small model's template may not know a tool role)."""
    fmt = getattr(getattr(env, "format", None), "name", None)
    tools = (env.tool_schemas() or None) if fmt != "tags" else None   # tags tools are described in the prompt
    if isinstance(prompt, list) or (getattr(tokenizer, "chat_template", None) and fmt != "tags"):
        return ChatRenderer(tokenizer, tools=tools)
    return TextRenderer(tokenizer)


def row_dicts(rows: Batch, tokenizer) -> list[dict]:
    """Each row as the dict an environment's reset takes. hflow's prompt batches hold token ids,
    a ground truth and extra columns: those become 'prompt' (decoded), 'answer' and the extras,
    unless the batch has such columns itself."""
    out = []
    for i in range(len(rows)):
        row = {}
        for key, value in rows.items():
            v = value[i]
            row[key] = v.tolist() if isinstance(v, torch.Tensor) else v
        extra = row.pop("extra", None)
        if isinstance(extra, dict):
            row = {**extra, **row}
        if "ground_truth" in row:
            row.setdefault("answer", row["ground_truth"])
        if "prompt" not in row and "prompt_ids" in row:
            row["prompt"] = tokenizer.decode(row["prompt_ids"], skip_special_tokens=True)
        out.append(row)
    return out


class PrefillCounter:
    """Prompt tokens the engine computed vs. those its requests carried, per session: a turn's
    prompt is the whole stream, and the prefix cache (RequestOutput.num_cached_tokens) spares
    the earlier turns' KV."""

    def __init__(self):
        self.computed: Counter = Counter()
        self.total: Counter = Counter()




def run_sessions(llm: LLM, sessions: dict, rollout: RolloutConfig, stop_ids: list[int], seed_of,
                 version: Optional[Callable[[], int]] = None,
                 between_steps: Optional[Callable[[], None]] = None) -> PrefillCounter:
    """Drive every session to its end on `llm` (which must be idle: an LLM, or anything with its
    add_request / step / abort / has_unfinished, such as a LockstepEngine); `seed_of(key, turn)`
    seeds each turn. `version()`: the policy version of the engine's weights now, recorded per
    token of each model turn (Segment.policy_versions). `between_steps()`: run after each engine
    step and, while every session waits for its tools, every OFFER_POLL_S; it may load newer
    weights (each load the next version). Returns the prefill counts per session key."""
    turns, turn_index = TurnRunner(), Counter()
    counts = PrefillCounter()
    queued_at: dict = {}   # key -> the version when its turn was queued

    def queue(key) -> None:
        s = sessions[key]
        ids = s.token_ids()
        if len(ids) >= llm.max_model_len:   # the engine cannot take it: the response budget is spent
            s.trajectory.finish(MAX_TOKENS)
            return
        params = SamplingParams(n=1, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                max_tokens=s.max_new_tokens(), stop_token_ids=stop_ids,
                                seed=seed_of(key, turn_index[key]))
        turn_index[key] += 1
        counts.total[key] += len(ids)
        if version is not None:
            queued_at[key] = version()
        llm.add_request(ids, params, request_id=key)

    try:
        for key, s in sessions.items():
            if not s.finished:
                queue(key)
        while llm.has_unfinished() or turns.pending:
            for out in llm.step():
                c = out.outputs[0]
                key = out.request_id
                counts.computed[key] += len(out.prompt_token_ids) - out.num_cached_tokens
                turns.submit(key, sessions[key], c.token_ids, c.logprobs)
                if version is not None:   # the turn just recorded: its tokens' versions
                    first, changes = queued_at.pop(key), sorted(c.weight_changes)
                    sessions[key].trajectory.segments[-1].policy_versions = [
                        first + bisect_right(changes, t) for t in range(len(c.token_ids))]
            if between_steps is not None:
                between_steps()
            # block only when the engine has nothing to decode: then a step (or its timeout) is all there is
            # (or, in a partial rollout, a push to take: look again every OFFER_POLL_S)
            idle_wait = None if between_steps is None else OFFER_POLL_S
            for key, ids in turns.collect(timeout=0 if llm.has_unfinished() else idle_wait):
                if ids is not None:
                    queue(key)
    except BaseException:
        for key in sessions:
            try:
                llm.abort(key)
            except KeyError:
                pass
        raise
    return counts


def _batchable(t: Trajectory, fallback_prompt: list[int], pad_id: int) -> Trajectory:
    """A trajectory that failed at reset has no prompt: it keeps its row as the row's own prompt
    ids and one masked pad token (reward 0, nothing trained on), so that rows stay i*n + j."""
    if t.prompt_ids:
        return t
    return dataclasses.replace(t, prompt_ids=list(fallback_prompt) or [pad_id], segments=[Segment([pad_id], None)])


def make_sessions(parts: list[tuple[int, list[dict]]], env: EnvSpec, rollout: RolloutConfig, limits: AgentLimits,
                  tokenizer) -> tuple[dict, dict]:
    """One AgentSession per (row, sample) of each part (its first global row, its rows' dicts),
    keyed (global row, sample); and the renderers they use (one for chat-message prompts, one for
    text)."""
    make_env = environment_factory(env)
    sessions, renderers = {}, {}
    for offset, dicts in parts:
        for i, row in enumerate(dicts):
            for j in range(rollout.n):
                e = make_env()
                kind = isinstance(row.get("prompt"), list)
                renderers[kind] = renderers.get(kind) or pick_renderer(tokenizer, e, row.get("prompt"))
                sessions[(offset + i, j)] = AgentSession(e, renderers[kind], row, limits)
    return sessions, renderers


def run_parts(llm, parts: list[tuple[int, list[dict]]], env: EnvSpec, rollout: RolloutConfig, limits: AgentLimits,
              tokenizer, version=None, between_steps=None) -> list[list[tuple]]:
    """Every part's trajectories on one engine (an LLM or a LockstepEngine): per part, per
    (row, sample) in order, (trajectory, prompt tokens its requests carried, those computed)."""
    sessions, renderers = make_sessions(parts, env, rollout, limits, tokenizer)
    stop_ids = sorted({*llm.eos_token_ids, *(r.end_of_turn_id for r in renderers.values())})
    counts = run_sessions(llm, sessions, rollout, stop_ids, lambda key, turn: turn_seed(rollout.seed, *key, turn),
                          version, between_steps)
    return [[(sessions[(offset + i, j)].trajectory, counts.total[(offset + i, j)], counts.computed[(offset + i, j)])
             for i in range(len(dicts)) for j in range(rollout.n)] for offset, dicts in parts]


def run_on_group(group: EngineGroup, part: tuple[int, list[dict]], env: EnvSpec, rollout: RolloutConfig,
                 limits: AgentLimits, tokenizer, version=None, runner=None) -> list[tuple]:
    """A tensor-parallel group's rollout: the leader runs every member's part on a LockstepEngine
    (with `runner`: run_parts, or agent_endpoint.serve_parts for an agent function), the others
    follow; each member gets its own part's results (as run_parts gives one)."""
    parts = group.gather(part)
    if not group.is_leader:
        group.follow()
        return group.scatter(None)
    with group.lead() as engine:
        results = (runner or run_parts)(engine, parts, env, rollout, limits, tokenizer, version)
    return group.scatter(results)


def sample_agent(llm: LLM | EngineGroup, rows: Batch, env: EnvSpec, rollout: RolloutConfig, limits: AgentLimits,
                 tokenizer, pad_id: int, mesh, row_offset: int = 0, version: Optional[Callable[[], int]] = None,
                 between_steps: Optional[Callable[[], None]] = None) -> Batch:
    """`rollout.n` trajectories per row on `llm` (awake, weights loaded, idle; an EngineGroup at
    tensor-parallel size > 1). `row_offset` is this shard's first row in the whole batch (the
    seeds are by global row). `version` / `between_steps`: run_sessions' (a rollout group's; not
    at tp > 1). Returns the batch described in the module docstring; every rank of `mesh` must
    call it (widths agree)."""
    dicts = row_dicts(rows, tokenizer)
    start_version = version() if version is not None else None
    runner, agent_fn = run_parts, environment_factory(env)
    if is_agent_function(agent_fn):   # an agent written with the openai client, served the engine over HTTP
        from hflow.workers.agent_endpoint import serve_parts
        runner, env = serve_parts, agent_fn
    if isinstance(llm, EngineGroup):
        if between_steps is not None:
            raise ValueError("partial rollouts at tensor-parallel size > 1: the group's ranks would have to load "
                             "the weights at the same step; not supported")
        results = run_on_group(llm, (row_offset, dicts), env, rollout, limits, tokenizer, version, runner)
    else:
        (results,) = runner(llm, [(row_offset, dicts)], env, rollout, limits, tokenizer, version, between_steps)

    fallback = [list(map(int, r.get("prompt_ids") or [])) for r in dicts]
    trajs = [_batchable(t, fallback[k // rollout.n], pad_id) for k, (t, _, _) in enumerate(results)]
    # every rank pads to the same widths, so that the dp shards concatenate (no mesh: this batch alone)
    P = max(len(t.prompt_ids) for t in trajs)
    R = max(len(t.response_ids()) for t in trajs)
    if mesh is not None:
        P, R = group_max(P, mesh), group_max(R, mesh)
    tensors = trajectory_tensors(trajs, pad_id, response_len=R, prompt_len=P)
    columns = {
        **tensors,
        **trajectory_columns(trajs),
        "prompt_tokens": torch.tensor([total for _, total, _ in results], dtype=torch.long),
    }
    columns["prefill_tokens"] = torch.tensor([computed for _, _, computed in results], dtype=torch.long)
    if runner is not run_parts:
        from hflow.workers.agent_endpoint import served_columns
        columns |= served_columns(trajs, columns)
    if version is not None:
        columns |= version_columns(trajs, start_version, R, limits.max_turns)
    out = Batch(columns, meta={**rows.meta, "n": rollout.n, "temperature": rollout.temperature})
    carried = rows.drop(*[k for k in (*_PROMPT_COLUMNS, *columns) if k in rows])
    if len(carried.keys()):
        out = carried.repeat(rollout.n, interleave=True) | out
    return out


def version_columns(trajs: list[Trajectory], start: int, response_len: int, max_turns: int) -> dict:
    """Which policy versions sampled each trajectory: policy_version [B] (its first model token's;
    `start` for one without a model turn), token_policy_version [B, R] (each response token's;
    an observation token carries the version of the turn before it) and turn_policy_version
    [B, max_turns] (each model turn's first token's; -1 past its last turn)."""
    B = len(trajs)
    row = torch.full((B,), start, dtype=torch.long)
    tokens = torch.full((B, response_len), start, dtype=torch.long)
    turns = torch.full((B, max_turns), -1, dtype=torch.long)
    for b, t in enumerate(trajs):
        at, current, turn = 0, start, 0
        for seg in t.segments:
            n = len(seg.token_ids)
            if seg.from_model and seg.policy_versions:
                if turn == 0:
                    row[b] = seg.policy_versions[0]
                if turn < max_turns:
                    turns[b, turn] = seg.policy_versions[0]
                tokens[b, at:at + n] = torch.tensor(seg.policy_versions, dtype=torch.long)
                current = seg.policy_versions[-1]
                turn += 1
            else:
                tokens[b, at:at + n] = current
            at += n
    return {"policy_version": row, "token_policy_version": tokens, "turn_policy_version": turns}
