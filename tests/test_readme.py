"""The README's commands stay true: every recipe command in it parses with that recipe's own
flags, every dotted flag it names exists, every script or module it runs exists and takes the
flags it is shown with, and the planner example runs. (The main job and the recipes' runs
themselves are run, smaller, by tests/test_recipes.py and the other recipe tests.)"""
import dataclasses
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tyro

from hflow.validation import fields_of, flag

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


RUNS = re.compile(r"(PYTHONPATH=\S+ )?(torchrun|srun torchrun|python|pip|\.\.\.|scripts/)\S* ")


def commands() -> list[str]:
    """Every command in the README that runs something: in its bash and plain blocks (the
    planner's), continuations joined, and in its inline code spans."""
    found, fence, block = [], None, []
    for line in README.splitlines():   # fenced blocks: ``` opens with a language (or none) and closes
        if line.startswith("```"):
            if fence is None:
                fence, block = line[3:].strip(), []
                continue
            if fence in ("bash", ""):
                for command in "\n".join(block).replace("\\\n", " ").splitlines():
                    command = command.split("  #")[0].strip()
                    if RUNS.match(command):
                        found.append(command)
            fence = None
        elif fence is not None:
            block.append(line)
    prose = re.sub(r"```.*?```", "", README, flags=re.S)   # so that the spans pair up
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if RUNS.match(span):
            found.append(span)
    return found


COMMANDS = commands()


def recipe_config(name: str):
    """recipes/<name>.py's Config class (None for a recipe without one)."""
    spec = importlib.util.spec_from_file_location(f"readme_recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(module)
    return getattr(module, "Config", None)


def recipe_invocations() -> list[tuple[str, list[str], str]]:
    """(recipe, its flags, the command) of every README command that runs a recipe; `...` and
    what follows `&&` are not flags."""
    found = []
    for command in COMMANDS:
        for part in command.split("&&"):
            match = re.search(r"recipes/(\w+)\.py(.*)", part)
            if match and (ROOT / "recipes" / f"{match[1]}.py").exists():
                args = [a for a in shlex.split(match[2]) if a != "..."]
                found.append((match[1], args, command))
    return found


INVOCATIONS = recipe_invocations()


def test_the_readme_has_the_commands_this_test_reads():
    assert any(c.startswith("pip install torch==2.13.0 -e . && torchrun") for c in COMMANDS)
    assert len(INVOCATIONS) >= 20 and {r for r, _, _ in INVOCATIONS} >= {"ppo", "grpo", "remax", "safe_rlhf", "agent"}


@pytest.mark.parametrize("recipe, args, command", INVOCATIONS, ids=[c[:60] for _, _, c in INVOCATIONS])
def test_every_recipe_command_parses_with_the_recipes_flags(recipe, args, command, capsys):
    try:
        tyro.cli(recipe_config(recipe), args=args)
    except SystemExit:
        pytest.fail(f"the README's `{command}` does not parse:\n{capsys.readouterr().err[-2000:]}")


def recipe_flags() -> set[str]:
    """Every flag of every recipe (booleans also as --x.no-y)."""
    flags = set()
    for path in sorted((ROOT / "recipes").glob("*.py")):
        config = recipe_config(path.stem)
        if config is None:
            continue
        for field_path, value in fields_of(config()):
            flags.add(flag(field_path))
            if isinstance(value, bool):
                flags.add(flag(field_path[:-1] + ("no_" + field_path[-1],)))
        for f in dataclasses.fields(config):   # a whole group named, e.g. --actor.lora.*
            flags.add(flag((f.name,)))
    return flags


def test_every_dotted_flag_the_readme_names_exists():
    known = recipe_flags()
    named = set(re.findall(r"--[a-z][a-z0-9-]*(?:\.[a-z][a-z0-9-]*)+", README))
    # a group's flags written as a prefix (`--actor.lora.*`, `--model.*`)
    missing = {f for f in named if f not in known and not any(k.startswith(f + ".") for k in known)}
    assert not missing, f"the README names flags no recipe has: {sorted(missing)}"


def runs_of(kind: str) -> list[tuple[str, list[str]]]:
    """(script or module, the --flags it is shown with) of every README command running one."""
    pattern = r"scripts/(\w+\.py)(.*)" if kind == "script" else r"python -m (hflow[\w.]*)(.*)"
    found = []
    for command in COMMANDS:
        for part in command.split("&&"):
            match = re.search(pattern, part)
            if match:
                flags = [a.split("=")[0] for a in re.findall(r"(?<![\w-])--[a-z][\w-]*", match[2])]
                found.append((match[1], [f for f in flags if f != "--help"]))
    return found


@pytest.mark.parametrize("script, flags", runs_of("script"), ids=[s for s, _ in runs_of("script")])
def test_every_script_the_readme_runs_exists_and_takes_its_flags(script, flags):
    path = ROOT / "scripts" / script
    assert path.exists(), script
    if not flags:
        return
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    missing = [f for f in flags if f not in out.stdout]
    assert not missing, f"scripts/{script} --help has no {missing}"


@pytest.mark.parametrize("module, flags", runs_of("module"), ids=[m for m, _ in runs_of("module")])
def test_every_module_the_readme_runs_takes_its_flags(module, flags):
    sub = ["plan"] if module == "hflow.planner" else []
    out = subprocess.run([sys.executable, "-m", module, *sub, "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    missing = [f for f in flags if f not in out.stdout]
    assert not missing, f"python -m {module} --help has no {missing}"


def test_the_planner_example_runs_and_prints_a_placement():
    command = next(c for c in COMMANDS if c.startswith("python -m hflow.planner plan --gpus"))
    out = subprocess.run([sys.executable, *shlex.split(command)[1:]], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "colocate" in out.stdout, out.stdout[-2000:]


def test_every_placement_spec_in_the_readme_places_its_recipes_roles():
    """The SPECs are shown for PPO (a reward role where --reward.model is given), or for GRPO
    (no reference, as scripts/bench_async.py runs it) with a rollout group of its own where
    they name one: each must resolve on as many ranks as
    it names, through the recipe's own rollout_sets."""
    from hflow.asynchronous import rollout_sets
    from hflow.placement import resolve

    specs = set(re.findall(r"`([a-z_,]+:[\d-]+(?:;[a-z_,]+:[\d-]+)+)`", README))
    assert len(specs) >= 2, specs
    for spec in specs:
        world = 1 + max(int(r) for r in re.findall(r"\d+", spec))
        if "rollout" in spec:
            algo, sets = "grpo", rollout_sets([["actor"]], spec, async_steps=0)
        else:
            algo, sets = "ppo", [["actor", "ref"], ["critic"] + (["reward"] if "reward" in spec else [])]
        placed = resolve(spec, sets, world, algo=algo, log=lambda line: None)
        assert sorted(placed) == sorted(r for s in sets for r in s), spec
