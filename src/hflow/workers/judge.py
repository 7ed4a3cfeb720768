"""The judge role: a generative model on the engine that writes a verdict on each response.

    judge = cluster.spawn(Judge, JudgeConfig(model_path=path, max_tokens=64), ranks=placement["judge"])
    out = judge.verdicts(Batch({"judge_prompt": texts}))   # "verdict", "verdict_tokens", "prompt_tokens"; meta judge_s

Each rank holds a whole engine (hflow.engine.LLM, tensor parallel 1) and judges its share of the
rows in one generate() call, greedily. Between calls the engine sleeps as the actor's does
(workers/hybrid_engine.py): its KV cache is freed, and with `free_weights_when_asleep` its
weights too (read again from the model's safetensors at the next call), so that colocated with
the actor it leaves the update the memory. Its tokenizer is its own (not the policy's): a rendered
prompt goes in as the text of one user turn of the judge's chat template, when it has one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoTokenizer

from hflow.batch import Batch
from hflow.distributed.parallel import device_of, release_freed_memory
from hflow.engine import LLM, SamplingParams
from hflow.engine.loader import safetensors_weights
from hflow.runtime.dispatch import dispatch


@dataclass
class JudgeConfig:
    model_path: str
    """a Hugging Face causal-LM directory (resolved by the controller: hflow.pretrained.resolve_model)"""
    max_tokens: int = 64
    """new tokens of one verdict"""
    free_weights_when_asleep: bool = False
    """also free the weights between calls (read from disk again at each call)"""
    max_num_seqs: int = 256
    """verdicts the engine writes at once"""


class Judge:
    """`verdicts(batch)`: one greedy verdict per row's "judge_prompt" (text)."""

    def __init__(self, mesh: DeviceMesh, cfg: JudgeConfig):
        self.mesh, self.cfg = mesh, cfg
        self.device = device_of(mesh)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.llm = LLM.from_pretrained(cfg.model_path, dtype=dtype, device=self.device, max_num_seqs=cfg.max_num_seqs)
        self._sleep()

    def _sleep(self) -> None:
        self.llm.sleep(level=2 if self.cfg.free_weights_when_asleep else 1)
        release_freed_memory(self.device)

    def _wake(self) -> None:
        self.llm.wake_up()
        if self.cfg.free_weights_when_asleep:   # the storage came back uninitialised
            self.llm.load_weights(safetensors_weights(self.cfg.model_path))

    def prompt_ids(self, text: str) -> list[int]:
        """The judge's tokens for a rendered prompt: a user turn of its chat template, or the bare text."""
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text)["input_ids"]

    def check_fit(self, prompts: list[list[int]]) -> None:
        """Refuse a prompt that leaves no room for a verdict in the judge's context (the engine
        would cut the verdict short, or refuse the prompt with no word of the judge's flags)."""
        room = self.llm.max_model_len - self.cfg.max_tokens
        longest = max((len(p) for p in prompts), default=0)
        if longest > room:
            raise ValueError(f"a judge prompt of {longest} tokens and a verdict of --reward.judge-max-tokens "
                             f"{self.cfg.max_tokens} do not fit the judge's context of {self.llm.max_model_len} "
                             f"tokens: shorten --reward.judge-template or --rollout.max-tokens, lower "
                             f"--reward.judge-max-tokens, or use a judge with a longer context")

    @dispatch("dp")
    @torch.no_grad()
    def verdicts(self, batch: Batch) -> Batch:
        """Per row: the verdict's text, its token count, the prompt's token count; meta judge_s,
        this rank's seconds (waking and sleeping included)."""
        began = time.perf_counter()
        prompts = [self.prompt_ids(text) for text in batch["judge_prompt"]]
        self.check_fit(prompts)
        self._wake()
        try:
            outputs = self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=self.cfg.max_tokens))
        finally:
            self._sleep()
        completions = [out.outputs[0] for out in outputs]
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        return Batch({"verdict": texts,
                      "verdict_tokens": torch.tensor([len(c.token_ids) for c in completions]),
                      "prompt_tokens": torch.tensor([len(p) for p in prompts])},
                     meta={"judge_s": time.perf_counter() - began})
