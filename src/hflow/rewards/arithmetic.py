"""The default task's checker: "12+35=" -> the completion must start with "47"."""
import re

from hflow.rewards import inline_safe

# An optionally signed integer or decimal at the very start (after spaces). `\d+` is greedy, so
# "470" is read whole and is not mistaken for a right "47".
_LEADING_NUMBER = re.compile(r"\s*([+-]?\d+(?:\.\d+)?)")


@inline_safe
def arithmetic_score(response: str, ground_truth, **extra) -> float:
    """1.0 when ``response`` starts with the number ``ground_truth`` (leading spaces allowed,
    anything may follow the number: "47", " 47.", "47<eos>..."), else 0.0."""
    match = _LEADING_NUMBER.match(response)
    if match is None:
        return 0.0
    try:
        return float(float(match.group(1)) == float(str(ground_truth).strip()))
    except ValueError:  # a ground truth that is not a number
        return 0.0
