"""The teacher of on-policy distillation (recipes/distill.py), checked on the controller before any
rank loads it: a model the workers support, with the student's tokenizer (the divergence compares
the two distributions token id by token id)."""
from __future__ import annotations

from hflow.pretrained import resolve_model
from hflow.recipe_kit.scoring import check_same_tokenizer
from hflow.recipe_kit.set_up import check_policy_dir
from hflow.validation import ConfigError


def teacher_dir(teacher: str, tokenizer, flag: str = "--distill.teacher") -> str:
    """`teacher` (a directory, a Hub id or a fetched name) resolved to a Hugging Face directory,
    checked: a supported causal LM whose tokenizer is the student's `tokenizer`."""
    if not teacher:
        raise ConfigError(f"{flag} is required: the model the student learns from (with the student's tokenizer)")
    path = resolve_model(teacher, flag)
    check_policy_dir(path)
    check_same_tokenizer(path, tokenizer, flag)
    return str(path)
