"""Requests, sequences and their outputs: the engine's bookkeeping types."""
from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class SamplingParams:
    """How to sample one prompt's completions (vLLM's names and meanings).

    `temperature` 0 is greedy. `top_k` 0 and `top_p` 1 switch those filters off.
    `stop_token_ids` None means the model's EOS ids; `ignore_eos` removes the EOS ids from the
    stop set (explicit stop ids that are not EOS still stop). `seed` fixes the sample stream:
    sample j of a request draws from a generator seeded with (seed, prompt, j), so the same
    request with the same seed gives the same tokens whatever else is in the batch, while
    different prompts sharing one SamplingParams(seed=s) still get independent samples.

    Log-probs under top-k / top-p: tokens are drawn from the filtered, renormalised
    distribution, but the log-prob returned is the token's under the *unfiltered*
    temperature-scaled one, log_softmax(logits / T)[token]: the function an RL trainer
    recomputes (hflow's `actor.log_probs`), so that these log-probs can stand for the old
    policy's and a first update's ratio is exactly 1. The filtered log-prob would be higher by
    log(1 / kept mass), biasing every ratio. (vLLM returns pre-temperature log-probs by default,
    the filtered ones with logprobs_mode="processed_logprobs"; verl recomputes unfiltered ones.)
    The update then treats samples of the filtered policy as samples of the unfiltered one, a
    small bias that vanishes with top_k=0, top_p=1, the defaults and the right values for RL.
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class CompletionOutput:
    """One sampled completion. `token_ids` end with the stop token when finish_reason is
    "stop" (the EOS or stop id sampled is part of the response: a trainer scores and learns
    the choice to stop, as vLLM returns it); with "length" there is none. `text` is
    tokenizer.decode(token_ids, skip_special_tokens=True), so a special EOS does not show
    (None when the engine has no tokenizer). `logprobs[t]` = log_softmax(logits / T)[token_ids[t]]
    (raw logits when T == 0), under the full distribution, before top-k/top-p filtering
    (SamplingParams says why)."""
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    text: str | None = None
    weight_changes: list[int] = field(default_factory=list)
    """The token indices at which the engine's weights were replaced while this completion ran
    (LLM.load_weights between steps): token t was sampled by the weights loaded
    sum(c <= t for c in weight_changes) loads after the first. Empty when none were."""
    routed_experts: torch.Tensor | None = None
    """MoE models: the experts the engine's router chose for every token it forwarded (the
    prompt and all but the last completion token), int32 [prompt + completion - 1, moe layers,
    top_k]; a prefix-cached token's are those recorded when it was computed, a token recomputed
    (preemption, new weights) has its latest. None for a dense model."""


@dataclass
class RequestOutput:
    """All completions of one request, `outputs[j]` for sample j; `prompt` is the prompt's text
    when generate() was given it as a string."""
    request_id: Hashable
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at the first prefill (vLLM's name): a multi-turn
    caller's earlier turns, or a shared system prompt. The last prompt token is always computed."""


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """One sample of one request: its tokens, its KV blocks and its random stream."""
    seq_id: int
    request_id: Hashable
    sample_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]
    max_len: int                      # prompt + completion may not grow past this (max_model_len)
    rng: random.Random
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0        # tokens whose KV was already in the cache when allocated
    prompt_cached_tokens: int | None = None   # num_cached_tokens of the first prefill (a preemption reallocates)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    weight_changes: list[int] = field(default_factory=list)   # CompletionOutput.weight_changes
    routed_experts: torch.Tensor | None = None              # CompletionOutput.routed_experts

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append(self, token_id: int, logprob: float) -> None:
        """Add a sampled token and mark the sequence finished when it should stop."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
        elif self.num_completion_tokens >= self.params.max_tokens or len(self) >= self.max_len:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.status = Status.FINISHED


def sample_rng(seed: int, prompt: list[int], sample_index: int) -> random.Random:
    """The random stream of sample `sample_index` of a request (seed, prompt).

    A string seed goes through SHA-512 in `random.seed`, so nearby seeds give unrelated
    streams; hashing a tuple of ints does not depend on PYTHONHASHSEED.
    """
    return random.Random(f"hflow-{seed}-{hash(tuple(prompt))}-{sample_index}")
