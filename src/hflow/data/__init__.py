"""Prompt data: ``DataConfig`` flags, file and built-in datasets, a resumable sampler.

    cfg = DataConfig(train_files=["train.parquet"], prompt_key="prompt", answer_key="answer")
    train = load_prompts(cfg, tokenizer, "train")        # PromptDataset of Prompt rows
    sampler = PromptSampler(train, cfg.batch_size, cfg.shuffle, cfg.seed)
    batch = next(sampler)                                 # list[Prompt], exactly batch_size
    ckpt["data"] = sampler.state_dict()                   # ... sampler.load_state_dict(ckpt["data"])

With no ``train_files`` the prompts come from the built-in ``task`` (2-digit arithmetic), whose
held-out split (``load_prompts(cfg, tokenizer, "val")``) never overlaps the training one.
"""
from hflow.data.config import DataConfig, DataError
from hflow.data.loading import ContextRoom, Prompt, PromptDataset, build_prompts, load_prompts, read_rows
from hflow.data.sampler import PromptSampler, iter_batches
from hflow.data.tasks import TASKS, ArithmeticTask, task_splits

__all__ = ["ContextRoom", "DataConfig", "DataError", "Prompt", "PromptDataset", "PromptSampler", "build_prompts",
           "iter_batches", "load_prompts", "read_rows", "TASKS", "ArithmeticTask", "task_splits"]
