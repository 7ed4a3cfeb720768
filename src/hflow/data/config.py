"""DataConfig: where prompts come from (``--data.*`` flags), and the error that names the flag."""
from dataclasses import dataclass, field

from hflow.validation import UserError


class DataError(UserError, ValueError):
    """Bad prompt data or data flags; the message names the flag to fix (and the file and line),
    so the run ends with it alone, no traceback."""


def flag(name: str) -> str:
    """The command-line flag of a DataConfig field, as tyro spells it in a recipe."""
    return "--data." + name.replace("_", "-")


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training prompts: .jsonl/.json, .parquet or .csv files, or datasets.save_to_disk directories; empty = the built-in --data.task."""
    val_files: list[str] = field(default_factory=list)
    """Held-out prompts for evaluation (same formats); empty = the built-in task's held-out split, or none."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages rendered with the tokenizer's chat template."""
    answer_key: str = "answer"
    """Column holding the ground truth given to the reward function ('a.b' reads a nested field; '' = none)."""
    chat: bool = False
    """Render string prompts too as one user message through the tokenizer's chat template."""
    system_prompt: str = ""
    """A system message put first in every chat prompt that has none of its own (it replaces the template's default one, e.g. to describe a tool); needs chat prompts (--data.chat or message lists). Empty: the template's own."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are dropped (and counted in a message)."""
    batch_size: int = 32
    """Prompts per training step (each is sampled --rollout.n times); the last partial batch of an epoch is skipped."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch."""
    seed: int = 0
    """Seed of the per-epoch shuffle."""
    task: str = "arithmetic"
    """Built-in generated task, used when --data.train-files is empty: arithmetic (2-digit a+b, a-b), multiply (3-digit x 2-digit a*b, recipes/agent.py's: the default model needs its calculator), code (write f(x) that passes three asserts; score it with --reward.fn code), or rg:NAME, any reasoning-gym dataset (pip install reasoning-gym; e.g. rg:chain_sum), a chat prompt scored by --reward.fn reasoning_gym."""
    task_args: list[str] = field(default_factory=list)
    """rg: tasks only: KEY=VALUE arguments of the dataset's config (e.g. min_terms=2 max_digits=2); a VALUE is read as JSON when it parses (2, 0.5, true, [1, 2]), else as a string."""
    task_seed: int = 0
    """Seed that generates the built-in task's problems and its train / held-out split."""
    task_size: int = 10000
    """rg: tasks only: problems drawn in all; the held-out split is the first --data.task-eval-size distinct ones, training every draw of another problem (repeats kept: both follow the task's own distribution)."""
    task_eval_size: int = 500
    """Held-out prompts of the built-in task, never trained on."""
