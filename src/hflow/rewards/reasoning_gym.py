"""``--reward.fn reasoning_gym``: a reasoning-gym problem scored by its own dataset's scorer.

The row (``--data.task rg:NAME``, hflow.data.reasoning_gym) carries the entry's ``question``,
``metadata`` (with ``source_dataset``) and ``task_config``; the entry is rebuilt from them and
the answer column, and ``score_answer(answer, entry)`` of that dataset decides.

The answer is taken out of the response first. A scorer compares the string it is given: handed
a whole prose response, chain_sum's gives partial credit for containing the answer (0.0625 for
a 16-times-longer text), which would reward rambling. So: the content of the last
``<answer>...</answer>`` (reasoning-gym's own convention), else the last number in the response
(the gsm8k reward's flexible extraction). A task whose answers are not numbers needs the tags:
ask for them in the prompt.

Not ``inline_safe``: some scorers simulate, parse or eval what they are given (sokoban, codeio,
n_queens), so they run in the reward workers, under the per-response timeout.
"""
import functools
import json
from typing import Optional

from hflow.rewards.gsm8k import extract_gsm8k_answer
from hflow.validation import UserError

_TUPLE, _ITEMS = "__tuple__", "__items__"   # JSON tags of what JSON has no type for


def import_reasoning_gym():
    """The reasoning_gym module, or an error that says how to install it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise UserError("reasoning-gym tasks (--data.task rg:NAME) and --reward.fn reasoning_gym need the "
                        "reasoning-gym package: pip install reasoning-gym (or pip install 'hflow[tasks]') "
                        f"({e})") from e
    return reasoning_gym


def encode_metadata(metadata) -> str:
    """An entry's metadata as JSON text that ``decode_metadata`` turns back into equal values.

    JSON text, not nested dicts, because metadata differs in keys and types from row to row and
    task to task: saved to a file and read back through ``datasets``, an Arrow struct column
    would add the keys other rows have (as None) and turn tuples into lists, which some scorers
    compare against (ARC boards). The tags keep tuples and non-string keys (graph_color's)."""
    return json.dumps(_tagged(metadata), default=lambda o: o.tolist() if hasattr(o, "tolist") else
                      json.JSONEncoder().default(o))   # numpy scalars and arrays; anything else fails


def decode_metadata(metadata):
    """``encode_metadata``'s inverse; a dict (rows built in Python, never saved) is returned as is."""
    return json.loads(metadata, object_hook=_untagged) if isinstance(metadata, str) else metadata


def _tagged(value):
    if isinstance(value, tuple):
        return {_TUPLE: [_tagged(v) for v in value]}
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not {_TUPLE, _ITEMS} & set(value):
            return {k: _tagged(v) for k, v in value.items()}
        return {_ITEMS: [[_tagged(k), _tagged(v)] for k, v in value.items()]}
    return value


def _untagged(obj: dict):   # json calls it innermost first: tagged keys are tuples already
    if len(obj) == 1 and _TUPLE in obj:
        return tuple(obj[_TUPLE])
    if len(obj) == 1 and _ITEMS in obj:
        return {k: v for k, v in obj[_ITEMS]}
    return obj


def extract_reasoning_gym_answer(response: str) -> Optional[str]:
    """The last ``<answer>`` tag's content (stripped), else the last number, else None."""
    import_reasoning_gym()   # the install hint, when it is missing
    from reasoning_gym.utils import extract_answer
    tagged = extract_answer(response)
    return tagged if tagged is not None else extract_gsm8k_answer(response, "flexible")


@functools.lru_cache(maxsize=64)
def score_answer_fn(source_dataset: str, task_config: str = ""):
    """The dataset's ``score_answer``. Built with the task's own config when the row says which
    (``task_config`` names the same dataset): a few scorers read it (decimal_arithmetic's
    precision, puzzle24's number range); else with the default config, as reasoning-gym's
    ``get_score_answer_fn`` does (a composite task's entries name their part)."""
    rg = import_reasoning_gym()
    config = json.loads(task_config) if task_config else {}
    if config.get("dataset") == source_dataset:
        return rg.create_dataset(source_dataset, **config.get("args", {})).score_answer
    return rg.get_score_answer_fn(source_dataset)


def reasoning_gym_score(response: str, ground_truth, metadata=None, question: str = "",
                        task_config: str = "", **extra) -> dict:
    """The dataset's score of the answer extracted from ``response`` (0 when none is found).
    Metric ``answer_found``: 0/1. ``metadata`` is JSON text (or a dict) holding ``source_dataset``."""
    metadata = decode_metadata(metadata)
    if not isinstance(metadata, dict) or "source_dataset" not in metadata:
        raise ValueError("reasoning_gym reward: the row has no metadata column with source_dataset "
                         "(use --data.task rg:NAME, or keep reasoning-gym's metadata in a 'metadata' column)")
    answer = extract_reasoning_gym_answer(response)
    if not answer:
        return {"score": 0.0, "answer_found": 0.0}
    entry = {"question": question, "answer": ground_truth, "metadata": metadata}
    score = score_answer_fn(metadata["source_dataset"], task_config or "")(answer, entry)
    return {"score": float(score), "answer_found": 1.0}
