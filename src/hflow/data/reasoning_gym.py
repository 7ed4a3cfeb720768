"""reasoning-gym's procedural datasets as built-in tasks: ``--data.task rg:chain_sum``.

reasoning-gym (``pip install reasoning-gym``, or ``hflow[tasks]``) generates about a hundred
kinds of problems that its own scorers verify, so a run needs no file:

    --data.task rg:chain_sum --data.task-args min_terms=2 max_terms=2 min_digits=1 max_digits=2

The held-out split never reaches training. Generators repeat problems at small sizes (chain_sum
with 2 terms of 1-2 digits poses about 1,650 distinct problems in 3,000 draws), so the draws are
deduplicated by question text before the held-out split is cut off the front: no training
problem has a held-out question. The draws are random by seed, so the front is a fair sample.

A row: ``prompt`` = one user message (rendered with the model's chat template), ``answer`` = the
entry's answer, and in ``extra`` what ``--reward.fn reasoning_gym`` needs to rebuild the entry
and its dataset's scorer: ``question``, ``metadata`` (JSON text: see hflow.rewards.reasoning_gym's
``encode_metadata`` for why) and ``task_config`` (JSON text of the dataset and its arguments).
"""
import difflib
import functools
import json
import logging
from dataclasses import dataclass, fields
from typing import Any, Sequence

from hflow.data.config import DataError, flag
from hflow.rewards.reasoning_gym import encode_metadata, import_reasoning_gym

logger = logging.getLogger("hflow.data")

PREFIX = "rg:"
REWARD_FN = "reasoning_gym"


def parse_task_args(items: Sequence[str]) -> dict[str, Any]:
    """``["min_terms=2", "op=add"]`` -> ``{"min_terms": 2, "op": "add"}``: a value is a JSON
    literal when it parses as one, else the string itself (so words need no quotes)."""
    args: dict[str, Any] = {}
    for item in items:
        key, equals, text = item.partition("=")
        key = key.strip()
        if not equals or not key:
            raise DataError(f"{flag('task_args')}: {item!r} is not KEY=VALUE (e.g. min_terms=2)")
        if key in args:
            raise DataError(f"{flag('task_args')}: {key!r} is given twice")
        if key in ("seed", "size"):
            raise DataError(f"{flag('task_args')}: set {key} with {flag('task_' + key)}, not here")
        try:
            args[key] = json.loads(text)
        except json.JSONDecodeError:
            args[key] = text
    return args


@dataclass(frozen=True)
class ReasoningGymTask:
    """``rg:<dataset>``: a reasoning-gym dataset with its config arguments (KEY=VALUE strings),
    scored by ``reward_fn`` (hflow.rewards.reasoning_gym)."""
    dataset: str
    args: tuple = ()
    reward_fn: str = REWARD_FN

    def splits(self, seed: int, size: int, eval_size: int) -> tuple[list[dict], list[dict]]:
        """(train rows, held-out rows) of ``size`` draws: the held-out split is the first
        ``eval_size`` distinct problems drawn; training is every draw of any other problem, in draw
        order, repeats kept. Both then follow the task's own distribution, less what the other
        holds, and share no problem. (Uniform over the distinct problems instead, a space that
        repeats its easy problems would become another task: chain_sum's 2-term 1-2-digit sums
        are half 1-digit as drawn, 12 % of the distinct problems; and cut from the distinct
        problems in draw order, the held-out split kept the easy ones and training the rest.)"""
        name, args = f"{PREFIX}{self.dataset}", parse_task_args(self.args)
        config = json.dumps({"dataset": self.dataset, "args": args}, sort_keys=True)
        drawn = _drawn_entries(self.dataset, seed, size, config)
        first_draws: dict[str, dict] = {}
        for entry in drawn:
            first_draws.setdefault(entry["question"], entry)
        held_out, distinct = list(first_draws.values())[:eval_size], len(first_draws)
        if not 0 < eval_size < distinct:
            raise DataError(f"{flag('task_eval_size')} must be in 1..{distinct - 1} for task {name!r}: "
                            f"{flag('task_size')} {size} drew {distinct} distinct problems "
                            f"(draw more, or make the task harder with {flag('task_args')})")
        held_out_questions = {e["question"] for e in held_out}
        train = [(i, e) for i, e in enumerate(drawn) if e["question"] not in held_out_questions]
        logger.info("task %s: %d draws, %d distinct: %d held out, %d draws of the other %d to train", name, size,
                    distinct, len(held_out), len(train), distinct - len(held_out))
        return ([_row(e, config, f"draw {i + 1} of task {name!r}") for i, e in train],
                [_row(e, config, f"held-out problem {i + 1} of task {name!r}") for i, e in enumerate(held_out)])


def _row(entry: dict, task_config: str, source: str) -> dict:
    return {"prompt": [{"role": "user", "content": entry["question"]}], "answer": entry["answer"],
            "extra": {"question": entry["question"], "metadata": encode_metadata(entry["metadata"]),
                      "task_config": task_config},
            "source": source}


@functools.lru_cache(maxsize=4)   # load_prompts asks for "train", then "val": generate once
def _drawn_entries(dataset: str, seed: int, size: int, task_config: str) -> tuple:
    """The generated entries in draw order."""
    if size < 2:
        raise DataError(f"{flag('task_size')} must be at least 2, got {size}")
    generator = _create(dataset, seed, size, json.loads(task_config)["args"])
    return tuple(generator[i] for i in range(size))


def _create(dataset: str, seed: int, size: int, args: dict):
    """``reasoning_gym.create_dataset``, its errors said in terms of the flags."""
    rg = import_reasoning_gym()
    from reasoning_gym.factory import DATASETS
    if dataset not in DATASETS:
        names = sorted(DATASETS)
        close = difflib.get_close_matches(dataset, names, n=4, cutoff=0.6)
        raise DataError(f"{flag('task')}: reasoning-gym has no dataset {dataset!r}"
                        + (f"; did you mean {', '.join(PREFIX + n for n in close)}?" if close else "")
                        + f" ({len(names)} datasets: {', '.join(names[:6])}, ... {names[-1]}; "
                        "all: python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')")
    try:
        return rg.create_dataset(dataset, seed=seed, size=size, **args)
    except TypeError as e:   # an argument the config has no field for
        known = [f.name for f in fields(DATASETS[dataset][1]) if f.name not in ("seed", "size")]
        raise DataError(f"{flag('task_args')}: {e}; {dataset}'s config takes {', '.join(known)}") from None
    except (AssertionError, ValueError) as e:   # the config's validate()
        raise DataError(f"{flag('task_args')}: {dataset} refuses {args}: {e}") from None
