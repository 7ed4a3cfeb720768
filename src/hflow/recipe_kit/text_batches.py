"""Between prompt rows, texts and Batches: what every recipe sends to the actor and reads back.

    prompts = prompt_batch(next(sampler))          # rows -> the Batch Actor.generate takes
    prompts = agent_prompt_batch(rows)             # + each prompt as an environment's reset reads it
    texts = response_texts(rollouts, tokenizer)    # the sampled responses as text
    batch = supervised_batch(rows, tokenizer)      # prompt + ground truth as the target completion
"""
from __future__ import annotations

from hflow import layout
from hflow.batch import Batch
from hflow.data import Prompt
from hflow.layout import sequence_tensors


def prompt_batch(prompts: list[Prompt]) -> Batch:
    """The rows a sampler yields, as the Batch `Actor.generate` takes (ids + ground truths)."""
    return Batch({"prompt_ids": [p.prompt_ids for p in prompts],
                  "ground_truth": [p.ground_truth for p in prompts],
                  "extra": [p.extra for p in prompts]})


def agent_prompt_batch(prompts: list[Prompt]) -> Batch:
    """prompt_batch's rows and each prompt as an environment's reset reads it ("prompt"): its
    chat messages, which the rollout's chat renderer renders once more into the same ids, or its
    text. Never the ids decoded: that drops the template's special tokens, and a chat renderer
    would then wrap the template's text in the template again."""
    return prompt_batch(prompts) | Batch({"prompt": [p.prompt if p.messages is None else p.messages for p in prompts]})


def response_texts(batch: Batch, tokenizer) -> list[str]:
    """The sampled responses as text, special tokens (EOS) dropped: the model's own tokens only
    (response_mask 1), so a multi-turn trajectory's observations are not part of it."""
    ids = [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def prompt_texts(batch: Batch, tokenizer) -> list[str]:
    """The prompts of a rollout Batch as text (its input_ids before the responses, padding dropped)."""
    start = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    ids = [row[:start][mask[:start].bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    return tokenizer.batch_decode(ids, skip_special_tokens=False)


def supervised_batch(prompts: list[Prompt], tokenizer) -> Batch:
    """Prompt + its ground truth as the target completion (ending with EOS), in the layout the
    Actor trains on."""
    targets = [tokenizer.encode(str(p.ground_truth), add_special_tokens=False) + [tokenizer.eos_token_id]
               for p in prompts]
    pad = layout.pad_id(tokenizer)
    return Batch(sequence_tensors([p.prompt_ids for p in prompts], targets, pad), meta={"n": 1})
