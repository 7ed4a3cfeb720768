"""LLM: the engine's front door (vLLM-shaped), with weights that can be swapped in place.

Requests go in with add_request() and come out of step(), which runs one forward step over
every running sequence and returns the requests it finished; a request added between steps
joins the running batch at the next prefill (continuous batching) and reuses the KV blocks of
any prefix already cached (prefix caching), so a turn of a conversation pays only for its new
tokens. generate() is that loop over a batch of prompts.

What the engine is made of lives beside it: weights read and copied in (loader.py), the KV
budget (kv_budget.py), the block manager, scheduler and model runner that LLM wires together.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig

from hflow.engine.block_manager import BlockManager
from hflow.engine.config import EngineConfig
from hflow.engine.kv_budget import num_kv_blocks, sized_from_memory, worth_resizing
from hflow.engine.loader import load_model, safetensors_weights, saved_tokenizer, stop_token_ids, unfilled_parameters
from hflow.engine.model_runner import ModelRunner
from hflow.engine.models import build_model
from hflow.engine.models.layers import TPInfo
from hflow.engine.scheduler import Scheduler
from hflow.engine.sequence import CompletionOutput, RequestOutput, SamplingParams, Sequence, Status, sample_rng
from hflow.pretrained import resolve_model


class LLM:
    """Paged-KV generation engine for Llama-family models.

        LLM.from_pretrained(path, dtype=torch.float32, **engine_opts)   # a Hugging Face directory
        LLM(hf_config, **engine_opts)                # uninitialised weights: fill with load_weights()

        outs = llm.generate(prompts, SamplingParams(n=4))     # a batch; outputs in prompt order
        request_id = llm.add_request(prompt_token_ids, SamplingParams(n=4))   # or request by request
        while llm.has_unfinished():
            for out in llm.step(): ...                        # the requests that finished in that step

    Engine options are the fields of EngineConfig (block_size, num_kv_blocks or
    kv_cache_bytes, max_num_seqs, max_num_batched_tokens, max_model_len,
    enable_prefix_caching, tp_group, gpu_memory_fraction), as keywords or as engine_config=EngineConfig(...);
    `device` and `dtype` place the weights and the cache (default: cpu/fp32). `eos_token_ids`
    overrides the stop ids found in the generation config / model config. `tokenizer` (a
    transformers tokenizer; from_pretrained: the directory's, loaded when first needed) lets
    generate() take strings and fills each output's `.text`.
    """

    def __init__(self, hf_config, *, dtype: torch.dtype | None = None, device=None,
                 eos_token_ids: list[int] | None = None, engine_config: EngineConfig | None = None,
                 tokenizer=None, **engine_opts):
        if isinstance(hf_config, (nn.Module, dict)):
            raise TypeError("LLM(...) takes a transformers config (model.config); give it the weights with "
                            "llm.load_weights(model.state_dict().items()), or use LLM.from_pretrained(path)")
        if engine_config is not None and engine_opts:
            raise ValueError(f"give engine_config or engine options {sorted(engine_opts)}, not both")
        cfg = engine_config or EngineConfig(**engine_opts)
        self.hf_config, self.engine_config, self.path = hf_config, cfg, None
        self.max_model_len = cfg.max_model_len or hf_config.max_position_embeddings
        if eos_token_ids is None:
            eos_token_ids = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.eos_token_ids = list(eos_token_ids or [])
        self.tp = TPInfo(cfg.tp_group)
        self.model = build_model(hf_config, self.max_model_len, self.tp, dtype or torch.float32,
                                 torch.device(device or "cpu"))
        # on a GPU without an explicit budget, the cache is sized from free memory each time it is allocated
        self._size_from_memory = sized_from_memory(self.model, cfg)
        self._asleep = self._weights_freed = False
        self._next_seq_id = self._next_request_id = 0
        self._requests: dict[Hashable, list[Sequence]] = {}   # unfinished requests -> their samples
        self._make_cache(self._num_kv_blocks())
        self._tokenizer, self._tokenizer_missing = tokenizer, False

    @property
    def tokenizer(self):
        """The tokenizer given, or the one saved beside from_pretrained's weights; None if neither."""
        if self._tokenizer is None and self.path is not None and not self._tokenizer_missing:
            self._tokenizer = saved_tokenizer(self.path)
            self._tokenizer_missing = self._tokenizer is None
        return self._tokenizer

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device=None, **engine_opts) -> "LLM":
        """Load a Hugging Face directory: config.json and *.safetensors (sharded or not). `path`
        may also be a .gguf file, a Hub id or a fetched name (hflow.pretrained.resolve_model)."""
        path = str(resolve_model(path))
        hf_config = AutoConfig.from_pretrained(path)
        llm = cls(hf_config, dtype=dtype, device=device, eos_token_ids=stop_token_ids(path), **engine_opts)
        unfilled = unfilled_parameters(llm.model, llm.load_weights(safetensors_weights(path)))
        if unfilled:
            raise ValueError(f"{path}: its safetensors hold no weights for {len(unfilled)} of the engine's parameters "
                             f"({', '.join(unfilled[:4])}{', ...' if len(unfilled) > 4 else ''})")
        llm.path = path
        return llm

    def _num_kv_blocks(self) -> int:
        return num_kv_blocks(self.model, self.engine_config, self.max_model_len, self._size_from_memory)

    def _make_cache(self, num_blocks: int) -> None:
        """The block manager, scheduler and model runner of a cache of `num_blocks` blocks (the
        cache itself is allocated by the first step)."""
        cfg = self.engine_config
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.block_manager)
        if self.runner.routing_shape is not None:
            self.scheduler.on_finish = self._keep_routing

    def _keep_routing(self, seq: Sequence) -> None:
        seq.routed_experts = self.runner.routed_experts(seq)

    # ---- weights and memory ----

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the existing parameter storage (no reallocation).

        With tensor parallelism each tensor may be the full one (this rank slices its part) or
        this rank's shard already: a contiguous chunk of dim 0 for q/k/v/gate/up (weights and
        biases), of dim 1 for o_proj/down_proj weights. Norms, embeddings, lm_head and
        row-parallel biases are replicated: always the full tensor. Returns the names loaded.

        Between two steps of unfinished requests (a partial rollout: the trainer's newer weights
        arrive while it runs), every running sequence is preempted, so that the next steps
        recompute its KV (prompt and tokens so far) with the new weights, and each unfinished
        completion records where the weights changed (CompletionOutput.weight_changes).
        """
        if self._requests:   # the cached KV of the running sequences is the old weights'
            self.scheduler.preempt_all()
            for seqs in self._requests.values():
                for seq in seqs:
                    if seq.status != Status.FINISHED:
                        seq.weight_changes.append(seq.num_completion_tokens)
        self.runner.unpack_weights()
        loaded = load_model(self.model, named_tensors)
        if self.block_manager.num_used_blocks == 0:
            self.block_manager.reset_prefix_cache()  # cached KV was computed by the old weights
        return loaded

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and also the weights' memory (level 2).

        After level 2 the parameters keep their identity and shape but hold no storage; the
        caller loads weights again after wake_up() (vLLM's semantics).
        """
        if self._requests:
            raise RuntimeError(f"sleep() with {len(self._requests)} unfinished requests: step() them to the end "
                               "or abort() them first")
        self.runner.free_kv_cache()
        self.block_manager.reset()
        self._asleep = True
        if level >= 2 and not self._weights_freed:
            self.runner.unpack_weights()
            for p in self._unique_parameters():
                p.data.untyped_storage().resize_(0)
            self._weights_freed = True

    def wake_up(self) -> None:
        """Restore what sleep() freed (the weights' storage comes back uninitialised, the KV
        cache is allocated by the next step)."""
        if self._weights_freed:
            for p in self._unique_parameters():
                p.data.untyped_storage().resize_(p.numel() * p.element_size())
            self._weights_freed = False
        self._asleep = False  # the KV cache comes back at the next step

    def _unique_parameters(self):
        return self.model.parameters()  # deduplicated: tied embeddings appear once

    # ---- requests and steps ----

    def add_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    request_id: Hashable | None = None) -> Hashable:
        """Queue `sampling_params.n` completions of a prompt (token ids); they join the running
        batch at the next step that has room. Returns the request's id (`request_id`, or a new
        int), which its RequestOutput carries."""
        params = sampling_params or SamplingParams()
        prompt = list(prompt_token_ids)
        if request_id is None:
            while self._next_request_id in self._requests:
                self._next_request_id += 1
            request_id = self._next_request_id
            self._next_request_id += 1
        elif request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already unfinished: give each request its own id")
        if self._asleep:
            raise RuntimeError("the engine is asleep: call wake_up() before adding requests")
        if not self._requests:
            self._start_batch()
        vocab = self.hf_config.vocab_size
        if not prompt:
            raise ValueError(f"prompt {request_id} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt {request_id} has token ids outside [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt {request_id} has {len(prompt)} tokens; max_model_len is {self.max_model_len}")
        longest = min(len(prompt) + params.max_tokens, self.max_model_len)
        bm = self.block_manager
        if -(-longest // bm.block_size) > bm.num_blocks:
            raise ValueError(f"a sequence of {longest} tokens needs more than the {bm.num_blocks} KV blocks "
                             "of the budget: raise num_kv_blocks / kv_cache_bytes")
        stop = set(self.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids)
        if params.ignore_eos:
            stop -= set(self.eos_token_ids)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        seqs = []
        for j in range(params.n):
            seq = Sequence(seq_id=self._next_seq_id, request_id=request_id, sample_index=j,
                           token_ids=list(prompt), num_prompt_tokens=len(prompt), params=params,
                           stop_ids=frozenset(stop), max_len=self.max_model_len, rng=sample_rng(seed, prompt, j))
            self._next_seq_id += 1
            self.scheduler.add(seq)
            seqs.append(seq)
        self._requests[request_id] = seqs
        return request_id

    def _start_batch(self) -> None:
        """The first request of an idle engine: size a cache that is to be allocated, reset the stats."""
        if self._size_from_memory and self.runner.kv_cache is None:
            num_blocks = self._num_kv_blocks()   # memory free now: training state may have grown
            if worth_resizing(self.block_manager.num_blocks, num_blocks):
                self._make_cache(num_blocks)
        self.block_manager.peak_used_blocks = self.block_manager.num_used_blocks
        self.scheduler.num_preemptions = 0

    def step(self) -> list[RequestOutput]:
        """One engine step (schedule, run the model, append the sampled tokens) over every
        running sequence. Returns the requests that finished in this step (their last samples
        ended in it), in the form generate() returns them; [] when there is nothing to run.
        A step that fails drops every request (its KV may be half written) and forgets the
        cached prefixes."""
        if not self._requests:
            return []
        try:
            seqs, is_prefill = self.scheduler.schedule()
            if is_prefill:
                for seq in seqs:
                    if seq.prompt_cached_tokens is None:
                        seq.prompt_cached_tokens = seq.num_cached_tokens
            seqs, tokens, logprobs = self.runner.step(seqs, is_prefill)
            done = self.scheduler.postprocess(seqs, tokens, logprobs)
        except BaseException:
            self._abort_all()
            raise
        finished = []
        for request_id in dict.fromkeys(seq.request_id for seq in done):   # once each, in order
            if all(s.status == Status.FINISHED for s in self._requests[request_id]):
                finished.append(self._request_output(self._requests.pop(request_id)))
        return finished

    def abort(self, request_id: Hashable) -> None:
        """Drop an unfinished request: its samples leave the queue or the running batch and their
        KV blocks are freed (its full blocks stay in the prefix cache for later requests)."""
        if request_id not in self._requests:
            raise KeyError(f"no unfinished request {request_id!r}")
        self.scheduler.abort(self._requests.pop(request_id))

    def has_unfinished(self) -> bool:
        """Whether a request added is still waiting or running."""
        return bool(self._requests)

    def _abort_all(self) -> None:
        self.scheduler.abort_all()
        self.block_manager.reset_prefix_cache()   # blocks registered by a failed step hold no KV
        self._requests.clear()

    def _request_output(self, seqs: list[Sequence]) -> RequestOutput:
        tokenizer = self.tokenizer

        def text(ids: list[int]) -> str | None:
            return None if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)
        first = seqs[0]
        return RequestOutput(first.request_id, first.token_ids[:first.num_prompt_tokens],
                             [CompletionOutput(s.sample_index, s.completion_token_ids, s.logprobs, s.finish_reason,
                                               text(s.completion_token_ids), s.weight_changes,
                                               s.routed_experts) for s in seqs],
                             num_cached_tokens=min(first.prompt_cached_tokens or 0, first.num_prompt_tokens - 1))

    # ---- a batch at once ----

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, between_steps: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Complete each prompt `params.n` times; outputs in prompt order, request ids 0, 1, ...
        A prompt is a string (tokenized with the engine's tokenizer, special tokens added as the
        tokenizer does) or a list of token ids; one prompt may be given alone. The engine must
        be idle (no request of add_request unfinished); after an error it is idle again, with
        no cached prefixes. `between_steps()` runs after each step while requests remain (it
        may load_weights: a partial rollout)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        prompt_token_ids = self._tokenize(prompts) if any(t is not None for t in texts) else prompts
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompt_token_ids)
        if len(sampling_params) != len(prompt_token_ids):
            raise ValueError(f"{len(sampling_params)} SamplingParams for {len(prompt_token_ids)} prompts")
        if self._requests:
            raise RuntimeError(f"generate() with {len(self._requests)} requests of add_request unfinished: "
                               "step() them to the end or abort() them first")
        outputs: dict[int, RequestOutput] = {}
        bar = None
        try:
            for i, (prompt, params) in enumerate(zip(prompt_token_ids, sampling_params)):
                self.add_request(prompt, params, request_id=i)
            if use_tqdm:
                bar = tqdm(total=sum(params.n for params in sampling_params), desc="generating", unit="seq")
            while self.has_unfinished():
                for out in self.step():
                    outputs[out.request_id] = out
                    if bar is not None:
                        bar.update(len(out.outputs))
                if between_steps is not None and self.has_unfinished():
                    between_steps()
        except BaseException:
            self._abort_all()  # leave the engine usable: no blocks held, no stale prefixes
            raise
        finally:
            if bar is not None:
                bar.close()
        for i, text in enumerate(texts):
            outputs[i].prompt = text
        return [outputs[i] for i in range(len(prompt_token_ids))]

    def _tokenize(self, prompts) -> list[list[int]]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer: load the engine with LLM.from_pretrained(dir) from "
                             "a directory holding one, or pass tokenizer=...; or give token ids")
        return [tokenizer(p)["input_ids"] if isinstance(p, str) else p for p in prompts]

    def stats(self) -> dict:
        """KV usage since the engine was last idle (for generate(): of that call): blocks in the
        budget, peak blocks in use, preemptions."""
        bm = self.block_manager
        return {"num_kv_blocks": bm.num_blocks, "block_size": bm.block_size,
                "peak_used_blocks": bm.peak_used_blocks, "num_preemptions": self.scheduler.num_preemptions}
