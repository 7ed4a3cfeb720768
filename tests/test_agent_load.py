"""Trajectories under load: what a step's and a tool call's timeouts count (not the time spent
queued for a free tool worker), a tool pool that serves calls first come first served, scoring
that does not queue every trajectory behind one lock, and hundreds of trajectories in flight
with slow tools. The tools sleep (tests/agent_load_tools.py), so that load costs no CPU."""
import threading
import time

import pytest

from agent_load_tools import crash, nap, slow_match
from hflow.agents import AgentLimits, AgentSession, TextRenderer, ToolEnvironment, ToolRunner, TurnRunner, as_tool


@pytest.fixture(scope="module")
def tok():
    from hflow.default.model import build_tokenizer
    return build_tokenizer()


def warm(runner: ToolRunner, fn=nap, arguments=None) -> None:
    """Every worker started and holding `fn`, so that nothing timed pays for starting processes."""
    calls = [threading.Thread(target=runner.call, args=(as_tool(fn), arguments or {"seconds": 0.3}, 120.0))
             for _ in range(runner.max_workers)]
    for t in calls:
        t.start()
    for t in calls:
        t.join()


def model_turn(tok, text: str) -> tuple[list[int], list[float]]:
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return ids, [-0.5] * len(ids)


def drive(tok, sessions: dict, turns_of) -> None:
    """Every session's turns through one TurnRunner, all in flight at once; `turns_of(key)` is a
    list of the model's turns as text, played in order."""
    runner, played = TurnRunner(), {key: list(turns_of(key)) for key in sessions}
    for key, s in sessions.items():
        runner.submit(key, s, *model_turn(tok, played[key].pop(0)))
    while runner.pending:
        for key, ids in runner.collect(timeout=None):
            if ids is not None:
                runner.submit(key, sessions[key], *model_turn(tok, played[key].pop(0)))


def finish_reasons(sessions: dict) -> dict:
    reasons = {}
    for s in sessions.values():
        reasons[s.trajectory.finish_reason] = reasons.get(s.trajectory.finish_reason, 0) + 1
    return reasons


def test_queueing_for_a_tool_worker_counts_against_neither_timeout(tok):
    """The review's case: 16 trajectories at once, one 1 s call each, 4 workers, a 2 s tool timeout
    and a 3 s step timeout. The last four calls wait 3 s for a worker: that is the pool's
    doing, not the policy's, and must not end their trajectories as env_timeout."""
    limits = AgentLimits(tool_timeout_s=2.0, step_timeout_s=3.0)
    with ToolRunner(max_workers=4) as runner:
        warm(runner)
        sessions = {i: AgentSession(ToolEnvironment([nap], format="tags", runner=runner), TextRenderer(tok),
                                    {"prompt": "sleep?"}, limits) for i in range(16)}
        start = time.monotonic()
        drive(tok, sessions, lambda key: ["<nap>1</nap>", "done"])
    assert finish_reasons(sessions) == {"done": 16}, [s.trajectory.error for s in sessions.values()]
    assert time.monotonic() - start < 4.0 + 4.0   # four waves of calls, and a loaded machine's slack


def test_a_lone_sessions_step_does_not_count_its_wait_for_a_worker_nor_the_workers_start(tok):
    """One worker, busy for a second with another caller's call; then a fresh worker's import of
    the session's tool takes 2 s. The step's 1.5 s are for its own work: the 0.1 s call."""
    from agent_slow_import_tools import quick
    from hflow.agents import run_episode
    with ToolRunner(max_workers=1) as runner:
        warm(runner)
        busy = threading.Thread(target=runner.call, args=(as_tool(nap), {"seconds": 1.0}, 30.0))
        busy.start()
        time.sleep(0.1)
        env = ToolEnvironment([quick], format="tags", runner=runner)
        session = AgentSession(env, TextRenderer(tok), {"prompt": "x?"}, AgentLimits(tool_timeout_s=1.0,
                                                                                     step_timeout_s=1.5))
        turns = ["<quick>7</quick>", "7"]
        trajectory = run_episode(session, lambda prompt_ids, max_new_tokens: model_turn(tok, turns.pop(0)))
        busy.join()
    assert (trajectory.finish_reason, trajectory.error) == ("done", None)
    assert tok.decode(trajectory.segments[1].token_ids) == "<result>7</result>"


def test_scoring_final_answers_does_not_queue_every_trajectory_behind_one_lock(tok):
    """Eight trajectories end at once, their answers scored by a function that takes 0.5 s: side
    by side in the tool workers, not one after another (4 s, past the step's 3 s)."""
    limits = AgentLimits(tool_timeout_s=2.0, step_timeout_s=3.0)
    with ToolRunner(max_workers=8) as runner:
        warm(runner)
        sessions = {i: AgentSession(ToolEnvironment([nap], format="tags", reward_fn=slow_match, runner=runner),
                                    TextRenderer(tok), {"prompt": "2+2=", "answer": "4"}, limits) for i in range(8)}
        start = time.monotonic()
        drive(tok, sessions, lambda key: ["4"])
        elapsed = time.monotonic() - start
    assert finish_reasons(sessions) == {"done": 8}, [s.trajectory.error for s in sessions.values()]
    assert [s.trajectory.reward() for s in sessions.values()] == [1.0] * 8
    assert elapsed < 3.0, elapsed


def test_the_tool_pool_serves_calls_first_come_first_served():
    """One worker; a caller that calls again the moment its call returns must not keep the worker
    from a caller already waiting: each waits at most for the calls queued before it."""
    call_s = 0.1
    with ToolRunner(max_workers=1) as runner:
        warm(runner)
        stop, hog_calls = threading.Event(), []

        def hog():   # bounded, so that a pool that lets it barge in fails the test in seconds
            while not stop.is_set() and len(hog_calls) < 40:
                hog_calls.append(runner.call(as_tool(nap), {"seconds": call_s}, 30.0))

        hogging = threading.Thread(target=hog)
        hogging.start()
        time.sleep(3 * call_s)
        waits = []
        for _ in range(5):
            asked = time.monotonic()
            outcome = runner.call(as_tool(nap), {"seconds": call_s}, 30.0)
            waits.append(float(outcome.text) - asked)
        stop.set()
        hogging.join()
    # one call ahead (the hog's), so a wait of about one call; the old pool let the hog barge in
    assert max(waits) < 2 * call_s + 0.5, waits


# ---------------------------------------------------------------- hundreds in flight

class RecordingRunner(ToolRunner):
    """Notes each nap's (asked, started, seconds): when its caller asked for it, when a worker
    started running it (the nap says), how long it slept."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.naps, self._noting = [], threading.Lock()

    def call(self, tool, arguments, timeout_s):
        asked = time.monotonic()
        outcome = super().call(tool, arguments, timeout_s)
        if tool.name == "nap" and outcome.status == "ok":
            with self._noting:
                self.naps.append((asked, float(outcome.text), arguments["seconds"]))
        return outcome


def load_turns(key: int) -> list[str]:
    """Two calls of 0.2-1 s (the same for a key on every run), then the answer; a few trajectories
    call a tool that overruns its timeout or kills its worker instead."""
    import random
    rng = random.Random(key)
    first = f"<nap>{rng.uniform(0.2, 1.0):.2f}</nap>"
    if key % 60 == 7:
        first = "<nap>3.0</nap>"
    elif key % 100 == 42:
        first = "<crash>9</crash>"
    return [first, f"<nap>{rng.uniform(0.2, 1.0):.2f}</nap>", str(key * 3)]


def test_hundreds_of_trajectories_with_slow_tools_none_starved_none_timed_out_for_the_queue(tok):
    """300 trajectories in flight at once, two 0.2-1 s calls each on 32 workers: calls wait up to
    ~10 s for a worker, past the 3 s step timeout, yet only the trajectories whose own call
    overran (5) or crashed its worker (3) fail, each counted by reason. No call waits longer
    than the calls queued before it take."""
    from hflow.agents import agent_rollout_metrics, trajectory_columns, trajectory_tensors
    from hflow.batch import Batch
    import torch
    n, workers, longest_call = 300, 32, 1.0
    limits = AgentLimits(tool_timeout_s=2.0, step_timeout_s=3.0)
    renderer = TextRenderer(tok)
    with RecordingRunner(max_workers=workers) as runner:
        warm(runner)
        runner.naps.clear()
        sessions = {key: AgentSession(ToolEnvironment([nap, crash], format="tags", reward_fn="arithmetic",
                                                      runner=runner),
                                      renderer, {"prompt": f"{key}*3=", "answer": str(key * 3)}, limits)
                    for key in range(n)}
        start = time.monotonic()
        drive(tok, sessions, load_turns)
        elapsed = time.monotonic() - start
        naps = sorted(runner.naps)

    trajs = [s.trajectory for s in sessions.values()]
    batch = Batch({**trajectory_tensors(trajs, pad_id=tok.pad_token_id), **trajectory_columns(trajs),
                   "prompt_tokens": torch.zeros(n, dtype=torch.long)})
    metrics = agent_rollout_metrics(batch)
    failures = {k.removeprefix("agent/failures/"): v for k, v in metrics.items() if k.startswith("agent/failures/") and v}
    waits = [started - asked for asked, started, _ in naps]
    # first come first served: a call waits for those asked before it and not yet started, a
    # worker's turn each (at most one call long), plus one call for a worker to come free
    ahead = [sum(1 for a, s, _ in naps if a < asked and s > asked) for asked, _, _ in naps]
    over = [(w, k) for w, k in zip(waits, ahead) if w > (k / workers + 1) * longest_call + 1.5]
    slept = sum(seconds for _, _, seconds in naps)
    print(f"\n{n} trajectories, {len(naps)} naps ({slept:.0f} s asleep) on {workers} workers in {elapsed:.1f} s "
          f"({slept / elapsed / workers:.0%} of the workers' time); wait for a worker: median "
          f"{sorted(waits)[len(waits) // 2]:.2f} s, max {max(waits):.2f} s (at most {max(ahead)} calls ahead); "
          f"failures {failures}; finish/done {metrics['agent/finish/done']:.3f}")
    assert failures == {"tool_timeout": 5, "tool_crash": 3}, {k: s.trajectory.error for k, s in sessions.items()
                                                                if s.trajectory.failed}
    assert metrics["agent/finish/done"] == pytest.approx((n - 8) / n) == metrics["agent/trajectory_reward"]
    assert max(waits) > limits.step_timeout_s   # the queue was long enough to have timed steps out before
    assert not over, over[:5]
    assert elapsed < 45, elapsed
