"""Preference pairs for reward and cost models: ``--data.*`` column flags, file and built-in pairs,
and the batch layout the RewardModel worker trains on.

A pair row is ``{"prompt", "chosen", "rejected"}`` (texts; the prompt may be a list of chat
messages, or None when chosen and rejected are whole dialogues) plus, for a cost model,
``"chosen_safe"`` and ``"rejected_safe"`` (bools). Chosen is the preferred response: the better
one for a reward model, the safer one for a cost model.

    rows = read_pair_rows(cfg, "train")                       # files, or the built-in pairs
    batch = pair_batch(rows[:32], tokenizer, cfg)             # 64 sequences: chosen, rejected, ...

Layouts (the flags that read them):

- prompt / chosen / rejected text columns: the defaults.
- HH-RLHF (``Anthropic/hh-rlhf``): ``chosen`` and ``rejected`` are whole dialogues
  ("\\n\\nHuman: ... \\n\\nAssistant: ...") that share everything up to the last answer:
  ``--data.prompt-key ''``. Their longest common token prefix becomes the prompt.
- PKU-SafeRLHF (``PKU-Alignment/PKU-SafeRLHF``): ``prompt``, ``response_0``, ``response_1``,
  ``better_response_id``, ``safer_response_id``, ``is_response_0_safe``, ``is_response_1_safe``.
  A reward model: ``--data.chosen-key response_0 --data.rejected-key response_1
  --data.preferred-key better_response_id``; a cost model: the same with
  ``--data.preferred-key safer_response_id --data.chosen-safe-key is_response_0_safe
  --data.rejected-safe-key is_response_1_safe``. The preferred column (0 or 1) says which of the
  two is chosen; the two responses and their safety labels swap when it is 1.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Callable

import torch

from hflow.batch import Batch
from hflow.data.config import DataError, flag
from hflow.data.loading import read_table, render_prompt
from hflow.data.safety import safety_preference_rows
from hflow.data.tasks import task_splits
from hflow.layout import sequence_tensors
from hflow.rewards.arithmetic import arithmetic_score

logger = logging.getLogger("hflow.data")


@dataclass
class PairDataConfig:
    """Preference pairs (``--data.*``): files with a column per part, or the built-in pairs."""

    train_files: list[str] = field(default_factory=list)
    """Training pairs: .jsonl/.json, .parquet or .csv files, or datasets.save_to_disk directories; empty = the built-in pairs of the embedded default (arithmetic: a right answer over a wrong one; with --cost, the safety task's pairs)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out pairs for pair accuracy; empty = the built-in pairs' held-out split, or the last --data.val-fraction of the training files."""
    val_fraction: float = 0.05
    """Share of the training pairs held out when there are train files but no --data.val-files."""
    prompt_key: str = "prompt"
    """Column of the prompt (text, or chat messages rendered with the tokenizer's template); '' = chosen and rejected are whole texts (HH-RLHF)."""
    chosen_key: str = "chosen"
    """Column of the preferred response (with --data.preferred-key: the first of the two responses)."""
    rejected_key: str = "rejected"
    """Column of the other response (with --data.preferred-key: the second)."""
    preferred_key: str = ""
    """Column holding 0 or 1: which of --data.chosen-key / --data.rejected-key is preferred (PKU-SafeRLHF: better_response_id; safer_response_id for a cost model); '' = always the first."""
    chosen_safe_key: str = "chosen_safe"
    """Cost model: bool column, is the first response safe (PKU-SafeRLHF: is_response_0_safe)."""
    rejected_safe_key: str = "rejected_safe"
    """Cost model: bool column, is the second response safe (PKU-SafeRLHF: is_response_1_safe)."""
    chat: bool = False
    """Render string prompts as one user message through the tokenizer's chat template."""
    max_length: int = 1024
    """Pairs with a sequence (prompt + response) longer than this many tokens are dropped (and counted)."""
    batch_size: int = 64
    """Pairs per optimizer step."""
    seed: int = 0
    """Seed of the per-epoch shuffle and of the built-in pairs."""


# ---------------------------------------------------------------- built-in pairs

def _digit_swapped(answer: int, place: int, rng: random.Random) -> int:
    """`answer` with its digit at `place` (0: units, 1: tens) replaced by another digit."""
    digit = answer // 10 ** place % 10
    return answer + (rng.choice([d for d in range(10) if d != digit]) - digit) * 10 ** place


def wrong_answer(a: int, b: int, op: str, answer: int, rng: random.Random) -> str:
    """A wrong response that teaches the check a policy fails. The warmed-up default's mistakes
    are mostly a wrong units digit (~70 %) or a wrong tens digit (~20 %), so those dominate;
    then the other operation's result, the digits reversed, a digit dropped or repeated; and
    malformed responses (no number, text before it, the answer run on into a longer number)."""
    kind = rng.random()
    if kind < 0.5:
        return str(_digit_swapped(answer, 0, rng))
    if kind < 0.7 and answer >= 10:
        return str(_digit_swapped(answer, 1, rng))
    if kind < 0.85:
        digits = str(answer)
        other = {a - b if op == "+" else a + b, int(digits[::-1]), answer // 10, int(digits + digits[-1])}
        other.discard(answer)
        return str(rng.choice(sorted(x for x in other if x >= 0) or [answer + 1]))
    return rng.choice(["", "=", f"={answer}", "+", f"{answer}{answer}", f"{answer}0"])


def arithmetic_preference_rows(split: str, seed: int = 0, mistakes: dict[str, list[str]] | None = None,
                               near_misses: bool = False) -> list[dict]:
    """Pairs on the built-in arithmetic task's `split` ("train" or "val": its training / held-out
    prompts for `seed`, as `--data.task arithmetic` splits them): the right answer over a
    `wrong_answer`, one per prompt, and over each of a policy's `mistakes` on it (prompt ->
    wrong responses, e.g. hflow.default.judges.policy_mistakes), and with `near_misses` over the
    answer ± 1 and ± 10 (a slipped units digit, a carry lost or added: the errors PPO finds a
    reward model rating right). Rows {"prompt", "chosen", "rejected"}; texts without EOS."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    train, held_out = task_splits("arithmetic", seed)
    rng = random.Random(f"arithmetic-pairs-{split}-{seed}")
    rows = []
    for problem in train if split == "train" else held_out:
        prompt, answer = problem["prompt"], int(problem["answer"])
        a, op, b = int(prompt[:2]), prompt[2], int(prompt[3:5])
        rejected = wrong_answer(a, b, op, answer, rng)
        while arithmetic_score(rejected, answer):   # "00" is a right 0: the checker decides
            rejected = wrong_answer(a, b, op, answer, rng)
        near = [str(x) for x in (answer - 10, answer - 1, answer + 1, answer + 10) if x >= 0] if near_misses else []
        for wrong in [rejected, *(mistakes or {}).get(prompt, []), *near]:
            rows.append({"prompt": prompt, "chosen": str(answer), "rejected": wrong})
    return rows


def builtin_pair_rows(kind: str) -> Callable[[str, int], list[dict]]:
    """The embedded default's pairs for a reward ("reward") or cost ("cost") model."""
    if kind == "reward":
        return arithmetic_preference_rows
    if kind == "cost":
        return safety_preference_rows
    raise ValueError(f"kind must be 'reward' or 'cost', got {kind!r}")


# ---------------------------------------------------------------- files

def _pair_from(row: dict, cfg: PairDataConfig, cost: bool, where: str) -> dict:
    first, second = row[cfg.chosen_key], row[cfg.rejected_key]
    safe = (row[cfg.chosen_safe_key], row[cfg.rejected_safe_key]) if cost else None
    if cfg.preferred_key:
        preferred = row[cfg.preferred_key]
        if preferred not in (0, 1):
            raise DataError(f"{flag('preferred_key')}: {where} holds {preferred!r}, expected 0 or 1")
        if preferred == 1:
            first, second = second, first
            safe = safe and safe[::-1]
    pair = {"prompt": row[cfg.prompt_key] if cfg.prompt_key else None, "chosen": first, "rejected": second}
    if cost:
        pair["chosen_safe"], pair["rejected_safe"] = bool(safe[0]), bool(safe[1])
    return pair


def read_pair_files(files: list[str], cfg: PairDataConfig, cost: bool, files_flag: str) -> list[dict]:
    """Pair rows from every file, in file order; a missing column names the flag to fix."""
    keys = {"prompt_key": cfg.prompt_key, "chosen_key": cfg.chosen_key, "rejected_key": cfg.rejected_key,
            "preferred_key": cfg.preferred_key}
    if cost:
        keys |= {"chosen_safe_key": cfg.chosen_safe_key, "rejected_safe_key": cfg.rejected_safe_key}
    rows = []
    for path in files:
        table = read_table(path, files_flag)
        for name, column in keys.items():
            if column and column not in table.column_names:
                raise DataError(f"{flag(name)}: column {column!r} is not in {path!r} "
                                f"(columns: {', '.join(table.column_names)})")
        if len(table) == 0:
            raise DataError(f"{files_flag}: {path!r} holds no rows")
        rows += [_pair_from(row, cfg, cost, f"row {i} of {path!r}") for i, row in enumerate(table)]
    return rows


def read_pair_rows(cfg: PairDataConfig, split: str, cost: bool = False) -> list[dict]:
    """The "train" or "val" pairs that `cfg` names: files, a held-out tail of the training
    files, or the embedded default's built-in pairs (`builtin_pair_rows`)."""
    if not cfg.train_files:
        return builtin_pair_rows("cost" if cost else "reward")(split, cfg.seed)
    if split == "val" and cfg.val_files:
        return read_pair_files(cfg.val_files, cfg, cost, flag("val_files"))
    rows = read_pair_files(cfg.train_files, cfg, cost, flag("train_files"))
    if cfg.val_files:
        return rows
    held = int(len(rows) * cfg.val_fraction)
    if not 0 < held < len(rows):
        raise DataError(f"{flag('val_fraction')} {cfg.val_fraction} of {len(rows)} pairs leaves no held-out "
                        f"or no training pair: change it, or give {flag('val_files')}")
    order = random.Random(cfg.seed).sample(range(len(rows)), len(rows))   # the same split every run
    picked = order[:held] if split == "val" else order[held:]
    return [rows[i] for i in sorted(picked)]


# ---------------------------------------------------------------- tokens

def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_tokens(row: dict, tokenizer, chat: bool) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen response ids, rejected response ids), each response ending with EOS
    as a rollout's does. Without a prompt the two texts' longest common token prefix is the
    prompt (at least one token: a sequence is scored from its first token on)."""
    eos = [tokenizer.eos_token_id]
    if row["prompt"] is None:
        chosen = tokenizer(row["chosen"])["input_ids"]
        rejected = tokenizer(row["rejected"])["input_ids"]
        cut = max(1, min(_common_prefix(chosen, rejected), len(chosen) - 1, len(rejected) - 1))
        return chosen[:cut], chosen[cut:] + eos, rejected[cut:] + eos
    text, is_chat = render_prompt(row["prompt"], tokenizer, chat, "a pair")
    prompt = tokenizer(text, add_special_tokens=not is_chat)["input_ids"]
    response = lambda s: tokenizer.encode(s, add_special_tokens=False) + eos   # noqa: E731
    return prompt, response(row["chosen"]), response(row["rejected"])


def tokenize_pairs(rows: list[dict], tokenizer, cfg: PairDataConfig) -> list[tuple]:
    """Token ids of every pair that fits `--data.max-length`; the rest dropped, with a message."""
    out = []
    for row in rows:
        prompt, chosen, rejected = pair_tokens(row, tokenizer, cfg.chat)
        if len(prompt) + max(len(chosen), len(rejected)) <= cfg.max_length:
            out.append((prompt, chosen, rejected, row.get("chosen_safe"), row.get("rejected_safe")))
    if rows and not out:
        raise DataError(f"{flag('max_length')}: all {len(rows)} pairs are longer than {cfg.max_length} tokens; raise it")
    if len(out) < len(rows):
        logger.warning("dropped %d of %d pairs longer than %s %d tokens", len(rows) - len(out), len(rows),
                       flag("max_length"), cfg.max_length)
    return out


def pair_batch(pairs: list[tuple], pad_id: int) -> Batch:
    """Tokenised pairs in the layout of hflow/layout.py, pair i as rows 2i (chosen) and
    2i+1 (rejected), plus `chosen` [2B] (1, 0, 1, 0, ...) and, when every pair has safety
    labels, `safe` [2B] (1.0 safe, 0.0 unsafe)."""
    prompts = [p[0] for p in pairs for _ in range(2)]
    responses = [r for p in pairs for r in (p[1], p[2])]
    tensors = sequence_tensors(prompts, responses, pad_id)
    tensors["chosen"] = torch.tensor([1.0, 0.0] * len(pairs))
    if pairs and all(p[3] is not None and p[4] is not None for p in pairs):
        tensors["safe"] = torch.tensor([float(s) for p in pairs for s in (p[3], p[4])])
    return Batch(tensors, meta={"n": 2})
