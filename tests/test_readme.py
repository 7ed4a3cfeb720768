"""The documentation's commands stay true, on every page: README.md and each docs/*.md. Every
recipe command on a page parses with that recipe's own flags, every dotted flag a page names
exists, every script or module a page runs exists and takes the flags it is shown with, the
planner example runs, every placement SPEC resolves, and every relative link points to a file
that exists. (The main job and the recipes' runs themselves are run, smaller, by
tests/test_recipes.py and the other recipe tests.)"""
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
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text()
         for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}


RUNS = re.compile(r"(PYTHONPATH=\S+ )?(torchrun|srun torchrun|python|pip|\.\.\.|scripts/)\S* ")


def commands(text: str) -> list[str]:
    """Every command on a page that runs something: in its bash and plain blocks (the
    planner's), continuations joined, and in its inline code spans."""
    found, fence, block = [], None, []
    for line in text.splitlines():   # fenced blocks: ``` opens with a language (or none) and closes
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
    prose = re.sub(r"```.*?```", "", text, flags=re.S)   # so that the spans pair up
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if RUNS.match(span):
            found.append(span)
    return found


COMMANDS = {page: commands(text) for page, text in PAGES.items()}


def recipe_config(name: str):
    """recipes/<name>.py's Config class (None for a recipe without one)."""
    spec = importlib.util.spec_from_file_location(f"readme_recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(module)
    return getattr(module, "Config", None)


def recipe_invocations() -> list[tuple[str, str, list[str], str]]:
    """(page, recipe, its flags, the command) of every command that runs a recipe; `...` and
    what follows `&&` are not flags."""
    found = []
    for page, page_commands in COMMANDS.items():
        for command in page_commands:
            for part in command.split("&&"):
                match = re.search(r"recipes/(\w+)\.py(.*)", part)
                if match and (ROOT / "recipes" / f"{match[1]}.py").exists():
                    args = [a for a in shlex.split(match[2]) if a != "..."]
                    found.append((page, match[1], args, command))
    return found


INVOCATIONS = recipe_invocations()


def test_the_readme_has_the_main_job_and_the_pages_the_recipe_commands():
    assert any(c.startswith("pip install torch==2.13.0 -e . && torchrun") for c in COMMANDS["README.md"])
    assert any(c == "pip install -q torch==2.13.0 -e '.[test]' && python -m pytest -q tests"
               for c in COMMANDS["README.md"])   # what .ci/run runs
    assert len(INVOCATIONS) >= 20 and {r for _, r, _, _ in INVOCATIONS} >= {"ppo", "grpo", "remax", "safe_rlhf", "agent"}
    assert len(PAGES) >= 10, sorted(PAGES)   # the README and its docs/ pages


@pytest.mark.parametrize("page, recipe, args, command", INVOCATIONS,
                         ids=[f"{p}: {c[:60]}" for p, _, _, c in INVOCATIONS])
def test_every_recipe_command_parses_with_the_recipes_flags(page, recipe, args, command, capsys):
    try:
        tyro.cli(recipe_config(recipe), args=args)
    except SystemExit:
        pytest.fail(f"{page}'s `{command}` does not parse:\n{capsys.readouterr().err[-2000:]}")


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


@pytest.fixture(scope="module")
def known_flags() -> set[str]:
    return recipe_flags()


@pytest.mark.parametrize("page", PAGES)
def test_every_dotted_flag_a_page_names_exists(page, known_flags):
    named = set(re.findall(r"--[a-z][a-z0-9-]*(?:\.[a-z][a-z0-9-]*)+", PAGES[page]))
    # a group's flags written as a prefix (`--actor.lora.*`, `--model.*`)
    missing = {f for f in named if f not in known_flags and not any(k.startswith(f + ".") for k in known_flags)}
    assert not missing, f"{page} names flags no recipe has: {sorted(missing)}"


def runs_of(kind: str) -> dict[str, list[tuple[str, list[str]]]]:
    """script or module -> (page, the --flags it is shown with) of every command running it."""
    pattern = r"scripts/(\w+\.py)(.*)" if kind == "script" else r"python -m (hflow[\w.]*)(.*)"
    found = {}
    for page, page_commands in COMMANDS.items():
        for command in page_commands:
            for part in command.split("&&"):
                match = re.search(pattern, part)
                if match:
                    # a quoted argument's flags are another command's (--hflow-args "--actor...")
                    args = re.sub(r"\"[^\"]*\"|'[^']*'", "''", match[2])
                    flags = [a.split("=")[0] for a in re.findall(r"(?<![\w-])--[a-z][\w-]*", args)]
                    found.setdefault(match[1], []).append((page, [f for f in flags if f != "--help"]))
    return found


def flags_not_in_help(help_text: str, shown: list[tuple[str, list[str]]]) -> list[str]:
    return sorted({f"{page}: {f}" for page, flags in shown for f in flags if f not in help_text})


SCRIPTS, MODULES = runs_of("script"), runs_of("module")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_a_page_runs_exists_and_takes_its_flags(script):
    path = ROOT / "scripts" / script
    assert path.exists(), f"{script}, run by {sorted({p for p, _ in SCRIPTS[script]})}"
    if not any(flags for _, flags in SCRIPTS[script]):
        return
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    missing = flags_not_in_help(out.stdout, SCRIPTS[script])
    assert not missing, f"scripts/{script} --help has no {missing}"


@pytest.mark.parametrize("module", MODULES)
def test_every_module_a_page_runs_takes_its_flags(module):
    sub = ["plan"] if module == "hflow.planner" else []
    out = subprocess.run([sys.executable, "-m", module, *sub, "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    missing = flags_not_in_help(out.stdout, MODULES[module])
    assert not missing, f"python -m {module} --help has no {missing}"


def test_the_planner_example_runs_and_prints_a_placement():
    command = next(c for cs in COMMANDS.values() for c in cs if c.startswith("python -m hflow.planner plan --gpus"))
    out = subprocess.run([sys.executable, *shlex.split(command)[1:]], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "colocate" in out.stdout, out.stdout[-2000:]


SPECS = sorted({(page, spec) for page, text in PAGES.items()
                for spec in re.findall(r"`([a-z_,]+:[\d-]+(?:;[a-z_,]+:[\d-]+)+)`", text)})


def test_the_pages_show_placement_specs():
    assert len(SPECS) >= 2, SPECS


@pytest.mark.parametrize("page, spec", SPECS, ids=[f"{p}: {s}" for p, s in SPECS])
def test_every_placement_spec_on_a_page_places_its_recipes_roles(page, spec):
    """The SPECs are shown for PPO (a reward role where --reward.model is given), or for GRPO
    (no reference, as scripts/bench_async.py runs it) with a rollout group of its own where
    they name one: each must resolve on as many ranks as it names, through the recipe's own
    rollout_sets."""
    from hflow.recipe_kit.async_rollouts import rollout_sets
    from hflow.placement import resolve

    world = 1 + max(int(r) for r in re.findall(r"\d+", spec))
    if "rollout" in spec:
        algo, sets = "grpo", rollout_sets([["actor"]], spec, async_steps=0)
    else:
        algo, sets = "ppo", [["actor", "ref"], ["critic"] + (["reward"] if "reward" in spec else [])]
    placed = resolve(spec, sets, world, algo=algo, log=lambda line: None)
    assert sorted(placed) == sorted(r for s in sets for r in s), f"{page}: {spec}"


def relative_links(text: str) -> list[str]:
    """The targets of a page's Markdown links that are not web addresses or anchors on the page,
    outside code."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`]*`", "", prose)
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_on_a_page_points_to_a_file_that_exists(page):
    base = (ROOT / page).parent
    broken = [t for t in relative_links(PAGES[page]) if not (base / t.split("#")[0]).exists()]
    assert not broken, f"{page} links to files that do not exist: {broken}"
