"""Multi-turn agents: environments, tools and token-exact trajectories (issue 24).

A trajectory is one token stream that only grows: the prompt, then the model's turns exactly as
sampled (with their log-probs) and, between them, each observation tokenised and appended
(response_mask 0, no log-prob). Nothing here knows the engine; an AgentSession is driven a turn
at a time by whatever generates (`session.token_ids()` is the next request's prompt, so an
engine's prefix cache reuses the KV of everything before).

    trajectory.py        Trajectory: segments, mask, log-probs, rewards, how it ended; agent_metrics
    render.py            ChatRenderer (observations as a delta of two template renders), TextRenderer
    environment.py       Environment, StepResult, AgentFailure, load_environment('module:Class')
    tools.py             Tool, as_tool (a function's JSON schema), ToolInputError
    formats.py           tool calls in the model's text: hermes (<tool_call>{json}), tags (<calc>..</calc>)
    builtin_tools.py     calculator (ast, no eval), python (hflow's code sandbox)
    tool_calls.py        ToolRunner: tool calls in worker processes of their own, each under a timeout, queued fairly
    step_clock.py        StepClock: a step's own time, its tool calls' waits for a worker left out
    tool_environment.py  ToolEnvironment: tools until a final answer, scored by an hflow reward function
    limits.py            AgentLimits: turns, tokens, observation size, timeouts
    session.py           AgentSession: one trajectory's state machine
    turns.py             run_episode (one session, a generate function), TurnRunner (many, beside an engine)
    tensors.py           trajectories -> the batch layout (hflow.layout) and their columns
    registry.py          environments by name: BUILTIN_ENVIRONMENTS, environment_factory (--agent.env)
    rollout_figures.py   a rollout batch's figures and failed trajectories, on the controller
    multi_question.py    MultiQuestion: problems one a turn, each answer rewarded (per-turn credit's task)
    endpoint/            an OpenAI-compatible endpoint: agents written with the openai client, recorded
    adapters/            environment libraries users have: textarena:GAME, gym:ENV, verifiers:TASKSET
"""
import importlib

# public name -> the module that defines it; imported on first use, so that a tool worker process
# (which imports hflow.agents.tool_calls) does not pay for torch and transformers
_EXPORTS = {
    "AgentFailure": "environment", "Environment": "environment", "StepResult": "environment",
    "load_environment": "environment",
    "BadCall": "formats", "HermesFormat": "formats", "TagsFormat": "formats", "ToolCall": "formats",
    "get_format": "formats",
    "AgentLimits": "limits",
    "ChatRenderer": "render", "ObservationError": "render", "Renderer": "render", "TemplateError": "render",
    "TextRenderer": "render", "TRUNCATION_MARKER": "render",
    "ToolOutcome": "tool_calls", "ToolRunner": "tool_calls", "shared_runner": "tool_calls",
    "AgentSession": "session", "EnvReply": "session",
    "TurnRunner": "turns", "run_episode": "turns",
    "trajectory_columns": "tensors", "trajectory_rewards": "tensors", "trajectory_tensors": "tensors",
    "ToolEnvironment": "tool_environment",
    "BUILTIN_TOOLS": "tools", "Tool": "tools", "ToolInputError": "tools", "as_tool": "tools", "tool": "tools",
    "tool_schema": "tools",
    "BUILTIN_ENVIRONMENTS": "registry", "EnvSpec": "registry", "environment_factory": "registry",
    "agent_rollout_metrics": "rollout_figures", "environment_failures": "rollout_figures",
    "FAILURES": "trajectory", "Segment": "trajectory", "failure_counts": "trajectory", "Trajectory": "trajectory", "agent_metrics": "trajectory",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"hflow.agents.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'hflow.agents' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
