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
of ranks.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter

import torch

from hflow.agents import (AgentLimits, AgentSession, ChatRenderer, Environment, Segment, TextRenderer,
                          Trajectory, TurnRunner, trajectory_columns, trajectory_tensors)
from hflow.agents.registry import EnvSpec, environment_factory
from hflow.agents.trajectory import MAX_TOKENS
from hflow.batch import Batch
from hflow.engine import LLM, SamplingParams
from hflow.workers.rollout_batches import RolloutConfig, group_max

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


def turn_seed(seed: int, row: int, sample: int, turn: int) -> int:
    digest = hashlib.sha256(f"hflow-agent-{seed}-{row}-{sample}-{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


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


def run_sessions(llm: LLM, sessions: dict, rollout: RolloutConfig, stop_ids: list[int], seed_of) -> PrefillCounter:
    """Drive every session to its end on `llm` (which must be idle); `seed_of(key, turn)` seeds
    each turn. Returns the prefill counts per session key."""
    turns, turn_index = TurnRunner(), Counter()
    counts = PrefillCounter()

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
        llm.add_request(ids, params, request_id=key)

    try:
        for key, s in sessions.items():
            if not s.finished:
                queue(key)
        while llm.has_unfinished() or turns.pending:
            for out in llm.step():
                c = out.outputs[0]
                counts.computed[out.request_id] += len(out.prompt_token_ids) - out.num_cached_tokens
                turns.submit(out.request_id, sessions[out.request_id], c.token_ids, c.logprobs)
            # block only when the engine has nothing to decode: then a step (or its timeout) is all there is
            for key, ids in turns.collect(timeout=0 if llm.has_unfinished() else None):
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


def sample_agent(llm: LLM, rows: Batch, env: EnvSpec, rollout: RolloutConfig, limits: AgentLimits, tokenizer,
                 pad_id: int, mesh, row_offset: int = 0) -> Batch:
    """`rollout.n` trajectories per row on `llm` (awake, weights loaded, idle). `row_offset` is
    this shard's first row in the whole batch (the seeds are by global row). Returns the batch
    described in the module docstring; every rank of `mesh` must call it (widths agree)."""
    make_env = environment_factory(env)
    dicts = row_dicts(rows, tokenizer)
    sessions, renderers = {}, {}   # one renderer for chat-message prompts, one for text
    for i, row in enumerate(dicts):
        for j in range(rollout.n):
            e = make_env()
            kind = isinstance(row.get("prompt"), list)
            renderers[kind] = renderers.get(kind) or pick_renderer(tokenizer, e, row.get("prompt"))
            sessions[(row_offset + i, j)] = AgentSession(e, renderers[kind], row, limits)
    stop_ids = sorted({*llm.eos_token_ids, *(r.end_of_turn_id for r in renderers.values())})
    counts = run_sessions(llm, sessions, rollout, stop_ids, lambda key, turn: turn_seed(rollout.seed, *key, turn))

    keys = list(sessions)
    fallback = [list(map(int, r.get("prompt_ids") or [])) for r in dicts]
    trajs = [_batchable(sessions[k].trajectory, fallback[k[0] - row_offset], pad_id) for k in keys]
    # every rank pads to the same widths, so that the dp shards concatenate (no mesh: this batch alone)
    P = max(len(t.prompt_ids) for t in trajs)
    R = max(len(t.response_ids()) for t in trajs)
    if mesh is not None:
        P, R = group_max(P, mesh), group_max(R, mesh)
    tensors = trajectory_tensors(trajs, pad_id, response_len=R, prompt_len=P)
    columns = {
        **tensors,
        **trajectory_columns(trajs),
        "prompt_tokens": torch.tensor([counts.total[k] for k in keys], dtype=torch.long),
    }
    columns["prefill_tokens"] = torch.tensor([counts.computed[k] for k in keys], dtype=torch.long)
    out = Batch(columns, meta={**rows.meta, "n": rollout.n, "temperature": rollout.temperature})
    carried = rows.drop(*[k for k in (*_PROMPT_COLUMNS, *columns) if k in rows])
    if len(carried.keys()):
        out = carried.repeat(rollout.n, interleave=True) | out
    return out
