"""GSM8K: the answer after ``####`` (strict) or the last number in the response (flexible).

Numbers are compared as values after dropping thousands separators and dollar signs, so
"#### $1,234.00" matches a ground truth of "1234". The ground truth may be the dataset's whole
reference solution ("... #### 72"): its ``####`` answer is used.
"""
import re
from decimal import Decimal, InvalidOperation
from typing import Optional

from hflow.rewards import inline_safe

# A number: digits with optional thousands commas, optional decimals. Written without nested
# quantifiers over the same characters, so matching is linear in the response length.
_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def _to_decimal(text: str) -> Optional[Decimal]:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except InvalidOperation:
        return None


def extract_gsm8k_answer(response: str, method: str = "strict") -> Optional[str]:
    """The answer string: strict takes the last ``#### <number>``; flexible the last number."""
    if method == "strict":
        matches = _STRICT.findall(response)
    elif method == "flexible":
        matches = _ANY_NUMBER.findall(response)
    else:
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    return matches[-1] if matches else None


def _ground_truth_value(ground_truth) -> Optional[Decimal]:
    text = str(ground_truth)
    if "####" in text:
        text = extract_gsm8k_answer(text, "strict") or ""
    return _to_decimal(text)


@inline_safe
def gsm8k_score(response: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0, **extra) -> dict:
    """``score`` when the extracted answer equals the ground truth, ``format_score`` when an
    answer was found but is wrong, 0 when none was found. Metric ``answer_found``: 0/1."""
    answer = extract_gsm8k_answer(response, method)
    value = None if answer is None else _to_decimal(answer)
    if value is None:
        return {"score": 0.0, "answer_found": 0.0}
    truth = _ground_truth_value(ground_truth)
    return {"score": score if value == truth else format_score, "answer_found": 1.0}


@inline_safe
def gsm8k_flexible_score(response: str, ground_truth, **extra) -> dict:
    """``gsm8k_score`` with ``method="flexible"`` (the last number in the response)."""
    return gsm8k_score(response, ground_truth, method="flexible", **extra)
