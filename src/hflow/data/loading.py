"""Prompt datasets: read files through ``datasets``, render prompts, tokenise, drop long ones.

Every source (files or a built-in task) becomes the same thing, a ``PromptDataset`` of rows:
prompt token ids, the prompt text they encode, the ground truth (the answer column) and the
row's other columns (``extra``, passed on to the reward function).

Tokenisation: a chat prompt is rendered with ``apply_chat_template(add_generation_prompt=True)``
and tokenised without adding special tokens (the template places them); a plain string prompt
is tokenised as the tokenizer does by default (e.g. with a BOS token for Llama).
"""
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from hflow.data.config import DataConfig, DataError, flag
from hflow.data.tasks import task_splits

logger = logging.getLogger("hflow.data")

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Prompt:
    """One prompt row, as the sampler yields it."""
    prompt_ids: list[int]
    prompt: str  # the text the ids encode (after the chat template)
    ground_truth: Any
    extra: dict = field(default_factory=dict)  # the row's other columns
    index: int = 0  # position in the PromptDataset
    messages: Optional[list] = None  # the chat messages the ids encode (system prompt included); None: plain text


@dataclass(frozen=True)
class ContextRoom:
    """The most tokens a prompt may have so that it and its response fit the model's context,
    and why, for messages ("the model's context of 256 tokens less --rollout.max-tokens 64")."""
    tokens: int
    why: str


@dataclass
class PromptDataset:
    """Tokenised prompts that passed the length filter; ``num_dropped`` were too long."""
    prompt_ids: list[list[int]]
    prompts: list[str]
    ground_truths: list[Any]
    extras: list[dict]
    source: str = ""
    num_dropped: int = 0
    messages: Optional[list] = None   # per prompt: its chat messages, or None for plain text (None: all plain)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __getitem__(self, i: int) -> Prompt:
        return Prompt(self.prompt_ids[i], self.prompts[i], self.ground_truths[i], self.extras[i], i,
                      self.messages[i] if self.messages else None)


# ---------------------------------------------------------------- reading files

def read_table(path: str, files_flag: str):
    """A ``datasets.Dataset`` from one file or save_to_disk directory."""
    import datasets   # loads on first use: `import hflow.data` stays quick for the built-in task
    if not os.path.exists(path):
        raise DataError(f"{files_flag}: no such file or directory: {path!r}")
    try:
        if os.path.isdir(path):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                ds = _pick_split(ds, path, files_flag)
            return ds
        fmt = _FORMATS.get(os.path.splitext(path)[1].lower())
        if fmt is None:
            raise DataError(f"{files_flag}: cannot read {path!r}: use .jsonl, .json, .parquet, "
                            ".csv or a directory written by datasets' save_to_disk")
        if os.path.getsize(path) == 0:
            raise DataError(f"{files_flag}: {path!r} holds no rows")
        return datasets.load_dataset(fmt, data_files=path, split="train")
    except DataError:
        raise
    except Exception as e:  # datasets/pyarrow raise many kinds for a corrupt or foreign file
        where = _first_bad_line(path) if os.path.isfile(path) else None
        if where:
            raise DataError(f"{files_flag}: cannot read {path}: {where}") from None
        raise DataError(f"{files_flag}: cannot read {path!r}: {type(e).__name__}: {e}") from e


def _first_bad_line(path: str) -> str | None:
    """Where a text file that failed to load goes wrong, counted as an editor counts (line 1
    first): the first line that is not UTF-8, or (.jsonl) not one JSON value; None if none is."""
    jsonl = path.lower().endswith(".jsonl")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {number} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); save the file as UTF-8"
            if jsonl and line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    return f"line {number} is not JSON: {e.msg} at column {e.colno}"
    return None


def _pick_split(ds, path: str, files_flag: str):
    if len(ds) == 1:
        return next(iter(ds.values()))
    wanted = ("train",) if files_flag == flag("train_files") else ("test", "validation", "val")
    for name in wanted:
        if name in ds:
            return ds[name]
    raise DataError(f"{files_flag}: {path!r} holds splits {sorted(ds)}; save the one to use "
                    "alone (datasets' DatasetDict['split'].save_to_disk)")


def _nested(row_value, path: Sequence[str], what: str):
    for key in path:
        if not isinstance(row_value, dict) or key not in row_value:
            raise KeyError(what)
        row_value = row_value[key]
    return row_value


def _holds_nan(value) -> bool:
    """Whether a ground truth is or holds a float NaN: how pandas (and json.dumps) write a missing
    value, which Arrow reads as a number, turning the column's ints into floats. It is a hole in
    the data, not an answer to score against."""
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, dict):
        return any(map(_holds_nan, value.values()))
    if isinstance(value, (list, tuple)):
        return any(map(_holds_nan, value))
    return False


def read_rows(files: Sequence[str], prompt_key: str, answer_key: str, files_flag: str) -> list[dict]:
    """Rows ``{"prompt", "answer", "extra", "source"}`` from every file, in file order."""
    rows = []
    for path in files:
        try:
            rows += _rows_of(path, prompt_key, answer_key, files_flag)
        except UnicodeDecodeError:   # pyarrow keeps the bytes; they fail only once read as text
            raise DataError(f"{files_flag}: cannot read {path}: {_first_bad_line(path) or 'not UTF-8'}") from None
    return rows


def _rows_of(path: str, prompt_key: str, answer_key: str, files_flag: str) -> list[dict]:
    """One file's rows (see read_rows)."""
    rows = []
    ds = read_table(path, files_flag)
    columns = ds.column_names
    answer_path = answer_key.split(".") if answer_key else []
    answer_column = answer_path[0] if answer_path else None
    if prompt_key not in columns:
        raise DataError(f"{flag('prompt_key')}: column {prompt_key!r} is not in {path!r} "
                        f"(columns: {', '.join(columns)})")
    if answer_column is not None and answer_column not in columns:
        raise DataError(f"{flag('answer_key')}: column {answer_column!r} is not in {path!r} "
                        f"(columns: {', '.join(columns)}); --data.answer-key '' reads prompts without answers")
    if len(ds) == 0:
        raise DataError(f"{files_flag}: {path!r} holds no rows")
    others = [c for c in columns if c not in (prompt_key, answer_column)]
    prompts = ds[prompt_key]
    answers = ds[answer_column] if answer_column else [None] * len(ds)
    other_values = {c: ds[c] for c in others}
    for i in range(len(ds)):
        try:
            answer = _nested(answers[i], answer_path[1:], answer_key)
        except KeyError:
            answer = None
        if answer is None and answer_key:
            raise DataError(f"{flag('answer_key')}: row {i + 1} of {path!r} has no {answer_key!r} value")
        if _holds_nan(answer):
            raise DataError(f"{flag('answer_key')}: row {i + 1} of {path!r} has NaN in its {answer_key!r} value "
                            "(a missing answer?): fill it in or drop the row")
        rows.append({"prompt": prompts[i], "answer": answer,
                     "extra": {c: other_values[c][i] for c in others}, "source": f"row {i + 1} of {path!r}"})
    return rows


# ---------------------------------------------------------------- rendering and tokenising

def prompt_messages(prompt, chat: bool, where: str, system_prompt: str = "") -> Optional[list]:
    """The chat messages a prompt is rendered from (``system_prompt`` first unless they begin
    with a system message), or None for a plain-text prompt (a string without ``chat``)."""
    if isinstance(prompt, str) and not chat:
        if system_prompt:
            raise DataError(f"{flag('system_prompt')}: {where} is a plain-text prompt, which has no system "
                            f"message; add {flag('chat')} to render prompts through the chat template")
        return None
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m
                                                          for m in prompt)):
        raise DataError(f"{flag('prompt_key')}: {where} holds {type(prompt).__name__} {str(prompt)[:60]!r}; "
                        "expected a string or a list of {'role', 'content'} messages")
    if system_prompt and prompt[0]["role"] != "system":
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    return [dict(m) for m in prompt]


def render_prompt(prompt, tokenizer, chat: bool, where: str, system_prompt: str = "") -> tuple[str, bool]:
    """(text, is_chat): a chat message list or (with ``chat``) a string through the template,
    ``system_prompt`` (when given) first unless the messages begin with a system message."""
    messages = prompt_messages(prompt, chat, where, system_prompt)
    return (prompt, False) if messages is None else (render_chat(messages, tokenizer), True)


def render_chat(messages: list, tokenizer) -> str:
    """Messages through the tokenizer's chat template, the assistant's turn opened."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{flag('prompt_key')}: prompts are chat messages but the tokenizer has no chat "
                        "template: use a chat model's tokenizer, or string prompts without --data.chat")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_prompts(rows: list[dict], tokenizer, max_prompt_length: int, chat: bool = False,
                  source: str = "", context_room: Optional[ContextRoom] = None,
                  system_prompt: str = "") -> PromptDataset:
    """Render and tokenise rows; drop (and count, with a message) prompts longer than the limit:
    `max_prompt_length`, or the room the model's context leaves beside the response when that
    is less (a longer prompt would stop the run when its batch came up)."""
    if max_prompt_length < 1:
        raise DataError(f"{flag('max_prompt_length')} must be >= 1, got {max_prompt_length}")
    # the messages are kept beside the ids for whoever renders the conversation further (a multi-turn rollout)
    messages = [prompt_messages(r["prompt"], chat, r.get("source", f"row {i}"), system_prompt)
                for i, r in enumerate(rows)]
    rendered = [(r["prompt"], False) if m is None else (render_chat(m, tokenizer), True) for r, m in zip(rows, messages)]
    ids: list[list[int]] = [None] * len(rows)
    for is_chat in (False, True):  # one batched tokenizer call per kind
        picked = [i for i, (_, c) in enumerate(rendered) if c == is_chat]
        if picked:
            encoded = tokenizer([rendered[i][0] for i in picked], add_special_tokens=not is_chat)["input_ids"]
            for i, e in zip(picked, encoded):
                ids[i] = list(e)
    limit, why = max_prompt_length, f"{flag('max_prompt_length')} {max_prompt_length}"
    if context_room is not None and context_room.tokens < limit:
        limit, why = context_room.tokens, context_room.why
    keep = [i for i in range(len(rows)) if len(ids[i]) <= limit]
    dropped = len(rows) - len(keep)
    if rows and not keep:
        raise DataError(f"all {len(rows)} prompts of {source} are longer than {limit} tokens ({why}; shortest: "
                        f"{min(map(len, ids))})")
    if dropped:
        logger.warning("%s: dropped %d of %d prompts longer than %d tokens (%s; longest: %d)", source,
                       dropped, len(rows), limit, why, max(map(len, ids)))
    return PromptDataset([ids[i] for i in keep], [rendered[i][0] for i in keep],
                         [rows[i]["answer"] for i in keep], [rows[i].get("extra", {}) for i in keep],
                         source=source, num_dropped=dropped,
                         messages=[messages[i] for i in keep] if any(m is not None for m in messages) else None)


def load_prompts(cfg: DataConfig, tokenizer, split: str = "train",
                 context_room: Optional[ContextRoom] = None) -> Optional[PromptDataset]:
    """The ``"train"`` or ``"val"`` prompts that ``cfg`` names, tokenised and length-filtered
    (``--data.max-prompt-length``, and ``context_room`` when given).

    Without ``--data.train-files`` both come from the built-in ``--data.task`` (disjoint splits).
    With train files, ``"val"`` reads ``--data.val-files`` and is None when there are none.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    files = cfg.train_files if split == "train" else cfg.val_files
    if files:
        files_flag = flag("train_files" if split == "train" else "val_files")
        rows = read_rows(files, cfg.prompt_key, cfg.answer_key, files_flag)
        source = f"{files_flag} {' '.join(files)}"
    elif split == "val" and cfg.train_files:
        return None  # file datasets have no held-out split unless one is given
    else:
        train, held_out = task_splits(cfg.task, cfg.task_seed, cfg.task_eval_size, cfg.task_size, cfg.task_args)
        rows = train if split == "train" else held_out
        source = f"task {cfg.task!r} ({split})"
    if not rows:
        raise DataError(f"{source} holds no prompts")
    return build_prompts(rows, tokenizer, cfg.max_prompt_length, cfg.chat, source, context_room, cfg.system_prompt)
