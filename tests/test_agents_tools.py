"""Tools: the calculator, schemas, the two call formats, the process runner and its faults, the
python tool in the code sandbox, and environments loaded by name."""
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

import pytest

from hflow.agents import (BadCall, HermesFormat, TagsFormat, ToolCall, ToolEnvironment, ToolInputError, ToolOutcome,
                          ToolRunner, as_tool, load_environment, tool)
from hflow.agents.builtin_tools import calculator


# ---------------------------------------------------------------- tools the runner's workers import

def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def broken(x: int) -> str:
    """Always raises.

    Args:
        x: Anything.
    """
    raise RuntimeError("the tool's own bug")


def garbage(x: int) -> str:
    """Returns something that is not text.

    Args:
        x: Anything.
    """
    return object()


def picky(x: int) -> str:
    """Refuses odd numbers, the caller's mistake.

    Args:
        x: An even number.
    """
    if x % 2:
        raise ToolInputError(f"{x} is odd")
    return x // 2


def die(code: int) -> str:
    """Ends its process, as a segfault in C would.

    Args:
        code: The exit code.
    """
    os._exit(code)


def move(x: int, y: int, fast: bool = False) -> dict:
    """Move somewhere.

    Args:
        x: Column.
        y: Row.
        fast: Run.
    """
    return {"at": [x, y], "fast": fast}


@pytest.fixture(scope="module")
def runner():
    with ToolRunner(max_workers=2) as r:
        # two calls at once, so that both workers exist (and have loaded) before anything is timed
        warm = [threading.Thread(target=r.call, args=(as_tool(nap), {"seconds": 0.3}, 60.0)) for _ in range(2)]
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        yield r


# ---------------------------------------------------------------- calculator

@pytest.mark.parametrize("expression, value", [
    ("27*82", "2214"), ("91-45", "46"), ("(3 + 4.5) / 2", "3.75"), ("27/3", "9"), ("0.1+0.2", "0.3"),
    ("2**10", "1024"), ("-2**2", "-4"), ("7//2", "3"), ("-7%3", "2"), ("1e3*2", "2000"), ("2**-1", "0.5"),
    ("2**4000 // 2**3999", "2"),
])
def test_the_calculator_computes(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("x+1", "names are not allowed"), ("__import__('os').system('ls')", "not arithmetic: Call"),
    ("(1).__class__", "not arithmetic: Attribute"), ("'a'*3", "only numbers"), ("True+1", "only numbers"),
    ("9**9**9", "too large"), ("2**5000", "too large"), ("(2**3000)*(2**3000)", "too large"),
    ("1e308*10", "too large"), ("1/0", "division by zero"), ("5%0", "division by zero"),
    ("(-8)**0.5", "not a real number"), ("1+", "not an arithmetic expression"), ("1" * 400, "longer than"),
    ("[1][0]", "not arithmetic"), ("1 if 1 else 2", "not arithmetic"), ("lambda: 1", "not arithmetic"),
])
def test_the_calculator_refuses(expression, why):
    with pytest.raises(ToolInputError, match=why):
        calculator(expression)


# ---------------------------------------------------------------- schemas and formats

def test_a_functions_schema_comes_from_its_hints_and_docstring():
    t = as_tool(move)
    assert t.name == t.tag == "move" and not t.inline
    assert t.schema["function"]["description"] == "Move somewhere."
    assert t.parameters["required"] == ["x", "y"]
    assert t.parameters["properties"]["fast"] == {"type": "boolean", "description": "Run."}
    calc = as_tool("calculator")
    assert (calc.name, calc.tag, calc.inline) == ("calculator", "calc", True)
    assert tool(name="go")(move) is move and as_tool(move).name == "go"   # the decorator returns the function
    del move.hflow_tool

    def undocumented(x):
        return x
    with pytest.raises(ValueError, match="type hint and a line under 'Args:'"):
        as_tool(undocumented)
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        as_tool("nope")
    with pytest.raises(ValueError, match="tool 'no_such_module:f': cannot import"):
        as_tool("no_such_module:f")


TOOLS = {t.name: t for t in map(as_tool, [calculator, move])}


def test_hermes_calls_are_read_and_garbage_is_a_bad_call():
    text = ('<think>hm</think>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>{"name": "move", "arguments": "{\\"x\\": 1, \\"y\\": 2}"}</tool_call>'
            '<tool_call>{"name": "move", "parameters": {"x": 1, "y": 2, "fast": true}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "move", "arguments": {"x": "1", "z": 0}}</tool_call>'
            '<tool_call>["calculator"]</tool_call><tool_call>{"name": "calc')
    calls = HermesFormat().parse(text, TOOLS)
    assert calls[:3] == [ToolCall(TOOLS["calculator"], {"expression": "1+1"}), ToolCall(TOOLS["move"], {"x": 1, "y": 2}),
                         ToolCall(TOOLS["move"], {"x": 1, "y": 2, "fast": True})]
    problems = [c.problem for c in calls[3:]]
    assert all(isinstance(c, BadCall) for c in calls[3:]) and len(problems) == 5
    assert "not valid JSON" in problems[0] and "unknown tool 'rm'; the tools are calculator, move" in problems[1]
    assert problems[2] == "bad arguments for move: missing y; unknown z; x must be of type integer"
    assert "JSON object" in problems[3] and "not closed" in problems[4]
    assert HermesFormat().parse("The answer is 4.", TOOLS) == []
    assert HermesFormat().result_message(calls[0], "2") == {"role": "tool", "content": "2", "name": "calculator"}


def test_tags_calls_are_read_and_garbage_is_a_bad_call():
    tools = {t.name: t for t in map(as_tool, [calculator, move, picky])}
    calls = TagsFormat().parse("<calc>27*82</calc> then <move>{\"x\": 1, \"y\": 2}</move><picky>4</picky>"
                               "<picky>four</picky><move>1 2</move><calc>1+", tools)
    assert calls[:3] == [ToolCall(tools["calculator"], {"expression": "27*82"}),
                         ToolCall(tools["move"], {"x": 1, "y": 2}), ToolCall(tools["picky"], {"x": 4})]
    assert [c.problem for c in calls[3:]] == ["<picky> takes a integer, not 'four'",
                                              "<move> takes a JSON object of its arguments",
                                              "<calc> was not closed with </calc>"]
    assert TagsFormat().parse("2214", tools) == [] and TagsFormat().parse("<unknown>1</unknown>", tools) == []


# ---------------------------------------------------------------- the runner

def test_tool_outcomes_in_worker_processes(runner):
    assert runner.call(as_tool(picky), {"x": 4}, 30.0) == ToolOutcome("ok", "2")
    outcomes = {name: runner.call(as_tool(fn), {"x": 3}, 30.0) for name, fn in
                [("picky", picky), ("broken", broken), ("garbage", garbage)]}
    assert (outcomes["picky"].status, outcomes["picky"].text) == ("bad_input", "3 is odd")
    assert (outcomes["broken"].status, outcomes["broken"].text) == ("error", "RuntimeError: the tool's own bug")
    assert outcomes["garbage"].status == "error" and "returned garbage: object" in outcomes["garbage"].text
    assert runner.call(as_tool(move), {"x": 1, "y": 2}, 30.0).text == '{"at": [1, 2], "fast": false}'
    local = runner.call(as_tool(_local_tool()), {"x": 1}, 30.0)   # a function inside a function cannot reach a worker
    assert local.status == "error" and "cannot be sent to worker processes" in local.text


def _local_tool():
    def local(x: int) -> str:
        """Defined inside a function.

        Args:
            x: Anything.
        """
        return "never"
    return local


def _two_at_once(runner, fn, arguments, timeout_s) -> list[ToolOutcome]:
    outcomes = []
    calls = [threading.Thread(target=lambda: outcomes.append(runner.call(as_tool(fn), arguments, timeout_s)))
             for _ in range(2)]
    for t in calls:
        t.start()
    for t in calls:
        t.join()
    return outcomes


def test_hanging_tools_time_out_side_by_side(runner):
    start = time.monotonic()
    outcomes = _two_at_once(runner, nap, {"seconds": 60}, 1.5)
    elapsed = time.monotonic() - start
    assert [o.status for o in outcomes] == ["timeout", "timeout"] and "timeout after 1.5s" in outcomes[0].text
    assert 1.5 <= elapsed < 2.9   # each within its timeout (+ margin), and not one after the other
    assert runner.call(as_tool(nap), {"seconds": 0}, 30.0).text == "slept 0"   # killed workers are replaced


def test_a_worker_that_dies_is_replaced_and_none_is_left_behind(runner):
    # other runners' workers (the shared runner of earlier tests in this process) are not this one's
    others = {p.pid for p in mp.active_children()} - {w.process.pid for w in runner._free if w.process is not None}
    assert runner.call(as_tool(die), {"code": 3}, 30.0) == ToolOutcome("crash", "die: worker died (exit code 3)")
    assert runner.call(as_tool(nap), {"seconds": 0}, 30.0).text == "slept 0"   # in a fresh worker
    idle = next(w.process for w in runner._free if w.process is not None)
    os.kill(idle.pid, signal.SIGKILL)   # dies while idle: the next call that gets it starts a fresh one
    idle.join(timeout=30)
    outcomes = _two_at_once(runner, nap, {"seconds": 0.2}, 30.0)
    assert [o.text for o in outcomes] == ["slept 0.2", "slept 0.2"]
    workers = [p for p in mp.active_children() if p.name == "hflow-tool-worker" and p.pid not in others]
    assert len(workers) <= runner.max_workers and all(p.is_alive() for p in workers)


def test_python_runs_in_the_code_sandbox(runner):
    python = as_tool("python")
    out = runner.call(python, {"code": "import math\nx = [i * i for i in range(5)]\nprint('squares', x)\nmath.fsum(x)"},
                      30.0)
    assert out == ToolOutcome("ok", "squares [0, 1, 4, 9, 16]\n30.0\n")


def test_python_tool_reports_errors_limits_and_long_output(monkeypatch):
    from hflow.agents import builtin_tools
    from hflow.sandbox import SandboxLimits

    fn = builtin_tools.python
    failing = fn("def f():\n    return 1 / 0\nf()")
    assert failing == ('Traceback (most recent call last):\n  File "<python>", line 3, in <module>\n'
                       '  File "<python>", line 2, in f\nZeroDivisionError: division by zero\n')
    assert fn("import socket").startswith("Traceback") and "socket" in fn("import socket")
    assert fn("print('x' * 1000)").endswith("x [output truncated]") and len(fn("print('x' * 1000)")) < 400
    monkeypatch.setattr(builtin_tools, "_PYTHON_LIMITS", SandboxLimits(wall_seconds=1.0, cpu_seconds=1.0))
    assert fn("while True:\n    pass").startswith("error: the program was stopped: ")


# ---------------------------------------------------------------- environments by name

ENV_FILE = '''
from hflow.agents import ToolEnvironment


def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: What to say.
    """
    return text.upper() + "!"


class ShoutEnv(ToolEnvironment):
    def __init__(self, runner=None):
        super().__init__([shout], format="hermes", runner=runner)


def solve(row, base_url):   # an agent function: served the engine over HTTP, not an environment
    return 1.0


NOT_A_CLASS = 42
'''


def test_an_environment_loads_by_path_or_module_and_its_tools_reach_the_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = tmp_path / "shout_agent_env.py"
    path.write_text(ENV_FILE)
    cls = load_environment(f"{path}:ShoutEnv")
    assert load_environment("shout_agent_env:ShoutEnv") is cls
    with ToolRunner(max_workers=1) as fresh:   # its worker starts after the file's folder joined sys.path
        env = cls(runner=fresh)
        env.reset({"prompt": "say hi"})
        result = env.step('<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call>')
    assert result.observation == [{"role": "tool", "content": "HI!", "name": "shout"}] and not result.done
    monkeypatch.delitem(sys.modules, "shout_agent_env")

    with pytest.raises(ValueError, match="no file"):
        load_environment(f"{tmp_path}/missing.py:ShoutEnv")
    with pytest.raises(ValueError, match="has no 'Missing'"):
        load_environment(f"{path}:Missing")
    with pytest.raises(ValueError, match="is not a class"):
        load_environment(f"{path}:NOT_A_CLASS")
    assert callable(load_environment(f"{path}:solve"))   # an agent function (hflow.agents.endpoint) is named alike
    with pytest.raises(ValueError, match="cannot import module 'no_such_env_module'.*PYTHONPATH"):
        load_environment("no_such_env_module:Env")
    shadow = tmp_path / "json.py"
    shadow.write_text(ENV_FILE)
    with pytest.raises(ValueError, match="the module name 'json' is taken by .*json/__init__.py; rename"):
        load_environment(f"{shadow}:ShoutEnv")


def test_a_tool_environment_refuses_clashing_tools():
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolEnvironment(["calculator", calculator])
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        ToolEnvironment(format="xml")
