"""verifiers environments as hflow agent functions: `--agent.env verifiers:TASKSET`.

    --agent.env verifiers:my_taskset     # a verifiers (0.4, `verifiers.v1`) taskset module you have installed

verifiers runs a rollout its own way: an `Env` over a taskset hands one task to a harness
program (here in a subprocess), whose model calls go through verifiers' interception server to
an OpenAI-compatible client, and the task's `@reward`s score the finished trace. hflow's side of
that is an agent function (hflow.agents.endpoint): `verifiers_agent(row, base_url, taskset=...)`
is called once per trajectory with the address of its session on hflow's endpoint, runs one
verifiers episode of the row's task against it, and returns the trace's reward (the sum of its
weighted rewards). Every model call the harness makes is a turn of the trajectory hflow trains.

What it chooses for the run, which `verifiers_agent`'s arguments change (a partial of it in a file
of your own, `--agent.env my_agent.py:agent`):
- the task: the row's `task` column (its index in the taskset) when it has one, else
  adapters.row_seed(row) modulo the taskset's size (the first 1024 of an endless one);
- the harness: the taskset's own when it exports one, else `null`, verifiers' chat loop without
  tools (its default, `bash`, runs what the model writes on this host);
- the runtime: `subprocess` (verifiers' default is a remote sandbox); the model name "hflow".

verifiers' harness programs stream their requests; the endpoint answers each with the whole turn
as server-sent events. verifiers needs `uv` (its harness program is
a PEP 723 script, prepared once per machine) and imports slowly (~7 s of CPU).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path
from typing import Optional

from hflow.agents.adapters import missing, one_line, require, row_seed

ENDLESS_TASKS = 1024   # how many of an endless taskset's tasks rows are spread over
_tasks_cache: dict[str, list] = {}


async def verifiers_agent(row: dict, base_url: str, taskset: str = "", harness: Optional[str] = None,
                          runtime: str = "subprocess", model: str = "hflow") -> dict:
    """One verifiers episode of the row's task against `base_url`; its reward and turns."""
    spec = f"verifiers:{taskset}"
    vf = require_v1(spec)
    from verifiers.v1.utils.loaders import default_harness_id, load_environment
    if harness is None:
        harness = default_harness_id(taskset)
        harness = "null" if harness == "bash" else harness
    env = load_environment(vf.SingleAgentEnvConfig(
        taskset={"id": taskset}, agent={"harness": {"id": harness}, "runtime": {"type": runtime}}))
    task = pick_task(env.taskset, taskset, row)
    # its harness streams its requests: the endpoint answers each with the whole turn as events
    ctx = vf.ModelContext(model=model, client=vf.EvalClientConfig(base_url=base_url, api_key_var="HFLOW_API_KEY"))
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    problems = list(episode.errors) + [e for t in episode.traces for e in (getattr(t, "errors", None) or [])]
    if not episode.ok or not episode.traces:
        what = "; ".join(f"{e.type}: {e.message}" for e in problems[:3]) or "no trace"
        raise RuntimeError(f"the verifiers episode of task {task.data.idx} failed: {what}"[:500])
    return {"reward": float(sum(t.reward for t in episode.traces)),
            "verifiers_turns": sum(t.num_turns for t in episode.traces)}


def require_v1(spec: str):
    """verifiers' v1 stack (verifiers >= 0.4), or one line saying what to install."""
    require("verifiers", spec)
    try:
        return importlib.import_module("verifiers.v1")
    except ModuleNotFoundError:
        raise ImportError(f"environment {spec!r}: hflow's verifiers adapter needs verifiers >= 0.4 (verifiers.v1): "
                          "pip install 'verifiers>=0.4'") from None


def pick_task(taskset, name: str, row: dict):
    """The row's task: its `task` column, else its seed, modulo the taskset's size."""
    if name not in _tasks_cache:
        view = taskset if taskset.bounded else taskset.take(ENDLESS_TASKS)
        _tasks_cache[name] = list(view)
    tasks = _tasks_cache[name]
    if not tasks:
        raise ValueError(f"verifiers taskset {name!r} has no tasks")
    index = int(row["task"]) if row.get("task") is not None else row_seed(row)
    return tasks[index % len(tasks)]


# ---- the name

def taskset_exists(name: str) -> bool:
    """Whether verifiers would find the taskset `name` (one of its own, or an installed module),
    looked up without importing verifiers (which takes seconds)."""
    module = name.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    found = importlib.util.find_spec("verifiers")
    own = Path(found.origin).parent / "v1" / "tasksets" / module if found and found.origin else None
    return bool(own and own.is_dir()) or importlib.util.find_spec(module) is not None


@functools.lru_cache(maxsize=None)
def check_taskset(name: str, spec: str) -> None:
    try:
        installed = importlib.util.find_spec("verifiers") is not None
    except (ImportError, ValueError):   # a module left half-imported, or taken out of sys.modules
        installed = False
    if not installed:
        raise missing("verifiers", spec)
    try:
        exists = taskset_exists(name)
    except (ImportError, ValueError) as e:
        raise ValueError(f"environment {spec!r}: {one_line(e)}") from None
    if not exists:
        raise ValueError(f"environment {spec!r}: no verifiers taskset {name!r} (neither one of verifiers' own "
                         f"nor an installed module {name.replace('-', '_').lower()!r})")


def factory(name: str, spec: str):
    check_taskset(name, spec)
    return functools.partial(verifiers_agent, taskset=name)
