"""Every flag that can be wrong, checked on rank 0 before anything loads, each problem named in
one line with its fix.

    check_config(cfg, output_dir_problems(cfg.trainer))   # raises ConfigError listing every bad flag
    prepare_output_dir(cfg.trainer)   # the run's directory: clear an earlier run, or resume it
    read_json_object(path, "--model.path m")   # a model's config.json, or a ConfigError naming the file

The output directory's two live with the checkpoints (checkpoint.dirs). `hflow.launch` calls
them (when it is given the Config class, it parses the flags itself, on rank 0 only), so a
recipe gets them for free; checks that need the placement (a batch that must divide by the
actor's ranks) stay in the recipe and raise ConfigError too.

The rules go by field name, wherever the field sits in the config tree (`--actor.optim.lr` and
`--critic.optim.lr` are both learning rates), so a recipe's own algorithm config is checked by
the same table as long as it reuses the usual names (clip_low, gamma, kl_coef, ...).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator


class UserError(Exception):
    """An error whose message is the whole story (what is wrong, what to do): `hflow.launch`
    prints it without a traceback, one `error:` line per line, and exits with `exit_code`."""
    exit_code = 1


class ConfigError(UserError, ValueError):
    """A flag's value cannot work; the message says which flag and what to do (status 2)."""
    exit_code = 2


def _at_least(low: float, what: str) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be >= {low:g} ({what})"


def _positive(what: str) -> Callable[[Any], str | None]:
    return lambda v: None if v > 0 else f"must be > 0 ({what})"


def _within(low: float, high: float, what: str, open_low=False, open_high=False) -> Callable[[Any], str | None]:
    def check(v):
        ok = (v > low if open_low else v >= low) and (v < high if open_high else v <= high)
        return None if ok else f"must be in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'} ({what})"
    return check


# field name -> check of its value (None: fine). Names not listed are not checked.
RULES: dict[str, Callable[[Any], str | None]] = {
    # counts
    "steps": _at_least(1, "RL steps"),
    "n": _at_least(1, "samples per prompt"),
    "batch_size": _at_least(1, "prompts per step"),
    "epochs": _at_least(1, "passes over each batch"),
    "micro_batch_size": _at_least(1, "sequences per forward on one rank"),
    "keep_last": _at_least(1, "checkpoints kept"),
    "max_skipped_steps": _at_least(0, "optimizer steps skipped before the run stops"),
    "tp_size": _at_least(1, "tensor-parallel size of the engine"),
    "shard_size": _at_least(0, "ranks a parameter is sharded over; 0: auto, 1: replicated"),
    "max_num_seqs": _at_least(1, "sequences the engine runs at once"),
    "block_size": _at_least(1, "tokens per KV-cache block"),
    "num_workers": _at_least(0, "reward worker processes (0: one per core, at most 4)"),
    "max_failed_batches": _at_least(0, "batches in a row whose scoring all failed before the run stops; 0: never"),
    "max_tokens": _at_least(1, "new tokens per response"),
    "max_prompt_length": _at_least(1, "prompt tokens"),
    "max_sampling_rounds": _at_least(1, "sampling rounds of dynamic sampling"),
    "mini_batch_size": _at_least(0, "prompts per optimizer step; 0: the whole batch"),
    "max_tokens_per_micro_batch": _at_least(0, "token budget of a micro-batch; 0: off"),
    "eval_every": _at_least(0, "steps between evaluations; 0: first and last only"),
    "save_every": _at_least(0, "steps between checkpoints; 0: never"),
    "eval_size": _at_least(0, "held-out prompts per evaluation"),
    "task_size": _at_least(2, "problems a reasoning-gym task generates"),
    "warmup_steps": _at_least(0, "learning-rate warm-up steps"),
    "total_steps": _at_least(0, "schedule length; 0: the run's steps"),
    "kv_cache_bytes": _at_least(0, "KV-cache budget; 0: automatic"),
    "max_model_len": _at_least(0, "longest sequence; 0: the model's"),
    "critic_warmup": _at_least(0, "steps that train only the critic"),
    "async_steps": _at_least(0, "steps generated ahead of training; 0: synchronous"),
    "overlong_buffer": _at_least(0, "tokens of the overlong penalty; 0: off"),
    # learning and sampling
    "lr": _positive("a learning rate"),
    "eps": _positive("AdamW epsilon"),
    "weight_decay": _at_least(0, "AdamW weight decay"),
    "min_lr_ratio": _within(0, 1, "fraction of the peak learning rate"),
    "grad_clip": _positive("max gradient norm"),
    "betas": lambda v: None if all(0 <= b < 1 for b in v) else "must each be in [0, 1) (AdamW betas)",
    "temperature": _at_least(0, "sampling temperature; 0: greedy"),
    "top_p": _within(0, 1, "nucleus sampling; 1: off", open_low=True),
    "top_k": _at_least(0, "top-k sampling; 0: off"),
    "gpu_memory_fraction": _within(0, 1, "share of GPU memory the engine may fill", open_low=True),
    # the algorithm
    "clip_low": _within(0, 1, "PPO clip below: ratio >= 1 - clip_low", open_low=True, open_high=True),
    "clip_high": _positive("PPO clip above: ratio <= 1 + clip_high"),
    "rank": _at_least(0, "the LoRA rank (0: off)"),
    "samples_every": _at_least(0, "steps between sample printouts (0: never)"),
    "alpha": _positive("LoRA's scale numerator (the update is scaled by alpha / rank)"),
    "rollout_correction_cap": _positive("the cap of the rollout correction's importance weight"),
    "dual_clip": lambda v: None if v is None or v > 1 else "must be > 1 (dual-clip constant), or unset",
    "value_clip": _positive("clip of the value predictions"),
    "gamma": _within(0, 1, "discount"),
    "lam": _within(0, 1, "GAE lambda"),
    "kl_coef": _at_least(0, "weight of the KL; 0: no reference model"),
    "kl_target": _positive("target KL per token"),
    "kl_horizon": _positive("horizon of the adaptive KL controller"),
    "entropy_coef": _at_least(0, "weight of the entropy bonus"),
    "center_coef": _at_least(0, "weight of the reward model's centering term; 0: plain Bradley-Terry"),
    "beta": _positive("DPO's beta, the pull towards the reference"),
    "timeout": _positive("seconds per reward call"),
    "judge_max_tokens": _at_least(1, "new tokens of a judge's verdict"),
    "judge_score_range": lambda v: None if len(v) == 2 and v[0] < v[1] else "must be two numbers, low < high",
    "log_every": _at_least(1, "steps between log lines"),
    "max_length": _at_least(1, "tokens of a sequence"),
    "stop_at": _within(0, 1, "held-out accuracy that ends training"),
    "sigma": _positive("a standard deviation"),
    # multi-turn agents (recipes/agent.py --agent.*)
    "max_turns": _at_least(1, "model turns per trajectory"),
    "max_turn_tokens": _at_least(1, "tokens of one model turn"),
    "max_observation_tokens": _at_least(1, "tokens of one observation"),
    "tool_timeout_s": _positive("seconds per tool call"),
    "step_timeout_s": _positive("seconds per environment step"),
    "turn_discount": _within(0, 1, "discount over turns (per-turn credit)"),
    "episode_weight": _at_least(0, "weight of the trajectory's group advantage beside the per-turn one"),
    "sapo_tau_pos": _positive("SAPO's gate temperature where the advantage is positive"),
    "sapo_tau_neg": _positive("SAPO's gate temperature where the advantage is not positive"),
    # on-policy distillation (recipes/distill.py --distill.*)
    "jsd_beta": _within(0, 1, "the teacher's weight in the generalised JSD's mixture"),
    "reward_weight": _at_least(0, "weight of the task reward's policy loss beside the divergence"),
}

# fields that name files or directories that must exist ("" and "default" mean the built-in one)
PATHS = ("path", "train_files", "val_files")


def flag(path: tuple[str, ...]) -> str:
    return "--" + ".".join(part.replace("_", "-") for part in path)


def fields_of(cfg, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, value) of every leaf field of a config dataclass tree."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from fields_of(value, path + (f.name,))
        else:
            yield path + (f.name,), value


def problems(cfg) -> list[str]:
    """One line per bad flag: `--rollout.n 0: must be >= 1 (samples per prompt)`."""
    found = []
    for path, value in fields_of(cfg):
        name = path[-1]
        rule = RULES.get(name)
        # None means "unset: the recipe picks", never wrong
        if rule is not None and isinstance(value, (int, float, tuple)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                found.append(f"{flag(path)} {value}: must be a finite number")
                continue
            message = rule(value)
            if message:
                found.append(f"{flag(path)} {value}: {message}")
        if name in PATHS:
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if item and item != "default" and not Path(item).expanduser().exists() and not names_a_model(name, item):
                    found.append(f"{flag(path)} {item}: no such file or directory")
    return found


# a fetched model's name (smollm2-135m-instruct) or a Hub id (org/name): hflow.pretrained's
# resolve_model (a layer above this one) turns it into a directory or refuses it, saying what to pass
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def names_a_model(name: str, item: str) -> bool:
    """Whether a missing `path` (the model's) has the shape of a model name, left to resolve_model."""
    return name == "path" and bool(MODEL_NAME.match(item))


def check_config(cfg, more: Iterable[str] = ()) -> None:
    """Raise ConfigError naming every flag whose value cannot work, and then the `more` problems
    found outside the flags' values (the launcher passes checkpoint.output_dir_problems: an
    output directory that would mix two runs)."""
    found = problems(cfg) + list(more)
    if found:
        raise ConfigError("\n".join(found))


def notices(cfg) -> list[str]:
    """Choices that are valid but easy to miss, said once at start."""
    found = []
    data = getattr(cfg, "data", None)
    if data is not None and getattr(data, "train_files", None) and not getattr(data, "val_files", None):
        found.append("--data.train-files without --data.val-files: no held-out evaluation (no eval/* "
                     "metrics); pass --data.val-files to evaluate")
    return found


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_json_object(path, where: str = "") -> dict:
    """The object a JSON file holds (a model's config.json), or a ConfigError that names the file
    and what is wrong with it, after `where` (the flag that led there): json's own error names
    neither, and a list read as a config fails later, far from the file."""
    prefix = f"{where}: " if where else ""
    try:
        value = json.loads(Path(path).read_bytes())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{prefix}{path} is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{prefix}{path} is not JSON: not UTF-8 text") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{prefix}{path} holds a JSON {_JSON_TYPES[type(value)]}, not an object {{...}} of settings")
    return value
