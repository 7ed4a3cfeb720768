"""A generative judge's text side: the prompt it is given and how its verdict becomes a score.

    template = judge_template(cfg)                         # --reward.judge-template, or the built-in one
    text = render(template, prompt, response, reference)   # one judge prompt
    score = parse_verdict("... Score: 7", "score", (0, 10))   # 0.7; None when unparsable

The parse rules (stated in --help and docs/recipes.md):
  score   the LAST "Score: N" (also "score = N", "**Score:** N") or "<score>N</score>" in the
          verdict, case-insensitive; N an integer or decimal inside --reward.judge-score-range
          [lo, hi], scaled to (N - lo) / (hi - lo) in [0, 1]. None found, or N outside the range:
          unparsable.
  yes_no  the LAST standalone word "yes" or "no", case-insensitive: 1 or 0. Neither: unparsable.
An unparsable verdict scores 0 and is counted (reward/judge_unparsable).

The engine side (the judge model on its ranks) is hflow.workers.judge.
"""
from __future__ import annotations

import re
import string
from pathlib import Path

from hflow.validation import ConfigError

FIELDS = ("prompt", "response", "reference")
PARSE_RULES = ("score", "yes_no")

_QUESTION = "Question:\n{prompt}\n\n"
_REFERENCE = "Reference answer:\n{reference}\n\n"
_ANSWER = "Answer to grade:\n{response}\n\n"
_ASK = {
    "score": ("Grade the answer to the question{against}. Give a score from {lo:g} (wrong) to {hi:g} (right) "
              "on the last line, written as \"Score: N\"."),
    "yes_no": "Is the answer to grade correct{against}? Reply Yes or No.",
}


def default_template(parse: str, score_range: tuple[float, float], with_reference: bool) -> str:
    """The built-in prompt: the question, the reference answer (when the row has one), the
    answer to grade, and the instruction the parse rule reads back."""
    lo, hi = score_range
    ask = _ASK[parse].format(against=" against the reference answer" if with_reference else "", lo=lo, hi=hi)
    return _QUESTION + (_REFERENCE if with_reference else "") + _ANSWER + ask


def template_fields(template: str) -> list[str]:
    """The named fields a template uses, in order ({prompt}, ...); a malformed one raises ValueError."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def load_template(path: str) -> str:
    """A --reward.judge-template file, checked: it exists, and uses only {prompt}, {response},
    {reference} (a literal brace is written twice: {{ }})."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"--reward.judge-template {path}: no such file")
    template = file.read_text()
    try:
        fields = template_fields(template)
    except ValueError as e:
        raise ConfigError(f"--reward.judge-template {path}: not a template ({e}); write a literal brace "
                          f"as {{{{ or }}}}") from None
    unknown = sorted({f for f in fields if f not in FIELDS})
    if unknown:
        named = ", ".join("{" + f + "}" for f in unknown)
        allowed = ", ".join("{" + f + "}" for f in FIELDS)
        raise ConfigError(f"--reward.judge-template {path}: unknown field(s) {named}; a template may use "
                          f"{allowed} (a literal brace: {{{{ or }}}})")
    if "response" not in fields:
        raise ConfigError(f"--reward.judge-template {path}: has no {{response}}: the judge would not see "
                          f"what it grades")
    return template


def render(template: str, prompt: str, response: str, reference) -> str:
    """The judge's prompt for one (prompt, response, reference); a missing reference is empty."""
    return template.format(prompt=prompt, response=response, reference="" if reference is None else str(reference))


# "Score: 7", "score = 7.5", "**Score:** 7", "<score>7</score>"
_SCORE = re.compile(r"(?:\bscore\b\s*\**\s*[:=]\s*\**\s*|<score>\s*)([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_verdict(verdict: str, rule: str = "score", score_range: tuple[float, float] = (0, 10)) -> float | None:
    """The score in [0, 1] the verdict states by `rule` (see the module docstring), or None
    when it states none the rule can read."""
    if rule == "score":
        found = _SCORE.findall(verdict)
        if not found:
            return None
        lo, hi = score_range
        value = float(found[-1])
        return (value - lo) / (hi - lo) if lo <= value <= hi else None
    if rule == "yes_no":
        found = _YES_NO.findall(verdict)
        return None if not found else float(found[-1].lower() == "yes")
    raise ValueError(f"unknown judge parse rule {rule!r}: use one of {', '.join(PARSE_RULES)}")
