"""Score functions by name: the built-ins, the ones a user registers, and `module:function`."""
import importlib
from typing import Any, Callable, Union

ScoreFn = Callable[..., Union[float, dict]]

# name -> "module:function"; imported on first use so that `import hflow.rewards` stays cheap
# (the math scorer pulls in sympy).
_REGISTRY: dict[str, Union[str, ScoreFn]] = {
    "arithmetic": "hflow.rewards.arithmetic:arithmetic_score",
    "gsm8k": "hflow.rewards.gsm8k:gsm8k_score",
    "gsm8k_flexible": "hflow.rewards.gsm8k:gsm8k_flexible_score",
    "math": "hflow.rewards.math_answer:math_score",
    "countdown": "hflow.rewards.countdown:countdown_score",
    "code": "hflow.rewards.code:code_score",
    "reasoning_gym": "hflow.rewards.reasoning_gym:reasoning_gym_score",   # needs reasoning-gym
}


def inline_safe(fn: ScoreFn) -> ScoreFn:
    """Mark a score function as fast and sure to return (no sympy, no eval, no I/O): batches
    of it are scored in the calling process, without worker processes or a timeout."""
    fn.inline_safe = True
    return fn


def register_reward_fn(name: str, fn: Union[ScoreFn, str]) -> None:
    """Make ``fn`` (a function or a ``"module:function"`` string) available as ``name``."""
    _REGISTRY[name] = fn


def reward_fn_names() -> list[str]:
    return sorted(_REGISTRY)


def _import_spec(spec: str) -> ScoreFn:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward function {spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = ("; torchrun does not put the working directory on sys.path: run with PYTHONPATH=. "
                "(or the module's folder), or pip install your package") \
            if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0] else ""
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r} ({e}){hint}") from e
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward function {spec!r}: module {module_name!r} has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


def get_reward_fn(name: Union[str, ScoreFn]) -> ScoreFn:
    """A score function by registered name (``"gsm8k"``) or ``"module:function"``; a callable
    is returned as is."""
    if callable(name):
        return name
    if name in _REGISTRY:
        entry = _REGISTRY[name]
        return _import_spec(entry) if isinstance(entry, str) else entry
    if ":" in name:
        return _import_spec(name)
    raise ValueError(
        f"unknown reward function {name!r}: use one of {', '.join(reward_fn_names())}, "
        "or 'package.module:function' for your own (set it with --reward.fn)"
    )
