"""LLM: the engine's front door (vLLM-shaped), with weights that can be swapped in place."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, GenerationConfig

from hflow.engine.block_manager import BlockManager
from hflow.engine.config import (DEFAULT_KV_CACHE_BYTES, EngineConfig, device_memory, kv_blocks_for_memory,
                                 step_activation_bytes)
from hflow.engine.model_runner import ModelRunner
from hflow.engine.models import build_model
from hflow.engine.models.layers import TPInfo
from hflow.engine.scheduler import Scheduler
from hflow.engine.sequence import CompletionOutput, RequestOutput, SamplingParams, Sequence, sample_rng


class LLM:
    """Paged-KV generation engine for Llama-family models.

        LLM.from_pretrained(path, dtype=torch.float32, **engine_opts)   # a Hugging Face directory
        LLM.from_model(hf_model)                     # an in-memory transformers model (copied)
        LLM.from_state_dict(state_dict, hf_config)   # Hugging Face names -> tensors
        LLM(hf_config) / LLM.from_config(hf_config)  # uninitialised; fill with load_weights()

    Engine options are the fields of EngineConfig (block_size, num_kv_blocks or
    kv_cache_bytes, max_num_seqs, max_num_batched_tokens, max_model_len,
    enable_prefix_caching, tp_group, gpu_memory_fraction), as keywords or as engine_config=EngineConfig(...);
    `device` and `dtype` place the weights and the cache (default: cpu/fp32; from_model: the
    model's). `eos_token_ids` overrides the stop ids found in the generation config / model config.
    `tokenizer` (a transformers tokenizer; from_pretrained: the directory's, loaded when first
    needed) lets generate() take strings and fills each output's `.text`.
    """

    def __init__(self, hf_config, *, dtype: torch.dtype | None = None, device=None,
                 eos_token_ids: list[int] | None = None, engine_config: EngineConfig | None = None,
                 tokenizer=None, **engine_opts):
        if isinstance(hf_config, (nn.Module, dict)):
            raise TypeError("LLM(...) takes a transformers config; use LLM.from_model(model) or "
                            "LLM.from_state_dict(state_dict, config) for weights")
        if engine_config is not None and engine_opts:
            raise ValueError(f"give engine_config or engine options {sorted(engine_opts)}, not both")
        cfg = engine_config or EngineConfig(**engine_opts)
        self._build(hf_config, dtype or torch.float32, device or "cpu", eos_token_ids, cfg)
        self._tokenizer, self._tokenizer_missing = tokenizer, False

    @property
    def tokenizer(self):
        """The tokenizer given, or the one saved beside from_pretrained's weights; None if neither."""
        if self._tokenizer is None and self.path is not None and not self._tokenizer_missing:
            # only with a saved tokenizer: transformers would build an empty one from config.json alone
            if any(os.path.exists(os.path.join(self.path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
                from transformers import AutoTokenizer
                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            else:
                self._tokenizer_missing = True
        return self._tokenizer

    @classmethod
    def from_config(cls, hf_config, dtype: torch.dtype = torch.float32, device=None, tp_group=None,
                    **engine_opts) -> "LLM":
        """The model with uninitialised weights (no copy of anything): fill with load_weights()."""
        if tp_group is not None:
            engine_opts["tp_group"] = tp_group
        return cls(hf_config, dtype=dtype, device=device, **engine_opts)

    @classmethod
    def from_model(cls, model: nn.Module, *, dtype: torch.dtype | None = None, device=None,
                   eos_token_ids: list[int] | None = None, **options) -> "LLM":
        """A copy of an in-memory transformers model's weights (its dtype and device by default;
        stop ids from its generation config)."""
        ref = next(model.parameters())
        gen = getattr(model, "generation_config", None)
        if eos_token_ids is None and gen is not None and gen.eos_token_id is not None:
            eos_token_ids = gen.eos_token_id
        llm = cls(model.config, dtype=dtype or ref.dtype, device=device or ref.device,
                  eos_token_ids=eos_token_ids, **options)
        llm.load_weights(model.state_dict().items())
        return llm

    @classmethod
    def from_state_dict(cls, state_dict: dict, hf_config, **options) -> "LLM":
        """Hugging Face-named tensors of a model whose transformers config is `hf_config`."""
        llm = cls(hf_config, **options)
        llm.load_weights(state_dict.items())
        return llm

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device=None, **engine_opts) -> "LLM":
        """Load a Hugging Face directory: config.json and *.safetensors (sharded or not)."""
        hf_config = AutoConfig.from_pretrained(path)
        eos = None
        if os.path.exists(os.path.join(path, "generation_config.json")):
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        llm = cls(hf_config, dtype=dtype, device=device, eos_token_ids=eos, **engine_opts)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            files = [os.path.join(path, f) for f in files]
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")

        def tensors():  # one tensor in memory at a time
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
        llm.load_weights(tensors())
        llm.path = path
        return llm

    def _build(self, hf_config, dtype, device, eos_token_ids, cfg: EngineConfig) -> None:
        self.hf_config, self.engine_config, self.path = hf_config, cfg, None
        self.max_model_len = cfg.max_model_len or hf_config.max_position_embeddings
        if eos_token_ids is None:
            eos_token_ids = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.eos_token_ids = list(eos_token_ids or [])
        self.tp = TPInfo(cfg.tp_group)
        self.model = build_model(hf_config, self.max_model_len, self.tp, dtype, torch.device(device))
        # on a GPU without an explicit budget, the cache is sized from free memory each time it is allocated
        self._size_from_memory = (cfg.num_kv_blocks is None and cfg.kv_cache_bytes is None
                                  and self.model.embed_tokens.weight.device.type != "cpu")
        self._asleep = self._weights_freed = False
        self._next_seq_id = 0
        self._make_cache(self._num_kv_blocks())

    def _num_kv_blocks(self) -> int:
        cfg = self.engine_config
        per_block = ModelRunner.bytes_per_block(self.model, cfg.block_size)
        wanted = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif cfg.kv_cache_bytes is not None:
            num_blocks = cfg.kv_cache_bytes // per_block
        elif not self._size_from_memory:
            num_blocks = min(wanted, DEFAULT_KV_CACHE_BYTES // per_block)
        else:
            device = self.model.embed_tokens.weight.device
            total, used = device_memory(device)
            elem = self.model.embed_tokens.weight.element_size()
            headroom = step_activation_bytes(self.hf_config, cfg.max_num_batched_tokens, cfg.max_num_seqs, elem)
            # a step's gathers reuse a workspace of up to one layer's blocks (attention.py)
            per_block_used = per_block + per_block // len(self.model.layers)
            num_blocks = min(wanted, kv_blocks_for_memory(total, used, cfg.gpu_memory_fraction, per_block_used,
                                                          headroom))
            if self.tp.size > 1:  # the ranks of a group must schedule alike: the smallest budget
                t = torch.tensor([num_blocks], device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
                num_blocks = int(t)
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block of {per_block} bytes")
        return num_blocks

    def _make_cache(self, num_blocks: int) -> None:
        """The block manager, scheduler and model runner of a cache of `num_blocks` blocks (the
        cache itself is allocated by the first step)."""
        cfg = self.engine_config
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.block_manager)

    # ---- weights and memory ----

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the existing parameter storage (no reallocation).

        With tensor parallelism each tensor may be the full one (this rank slices its part) or
        this rank's shard already: a contiguous chunk of dim 0 for q/k/v/gate/up (weights and
        biases), of dim 1 for o_proj/down_proj weights. Norms, embeddings, lm_head and
        row-parallel biases are replicated: always the full tensor. Returns the names loaded.
        """
        targets, loaded = self.model.weight_targets(), set()
        self.runner.unpack_weights()
        for name, tensor in named_tensors:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in targets:
                raise KeyError(f"load_weights: unexpected weight {name!r} for model_type "
                               f"{self.hf_config.model_type!r}")
            target, shard_dim = targets[name]
            self._copy(name, target, tensor, shard_dim)
            loaded.add(name)
        if self.block_manager.num_used_blocks == 0:
            self.block_manager.reset_prefix_cache()  # cached KV was computed by the old weights
        return loaded

    def _copy(self, name, target, tensor, shard_dim) -> None:
        tp = self.tp
        if tuple(tensor.shape) == tuple(target.shape):
            target.copy_(tensor)
            return
        if shard_dim is not None and tp.size > 1:
            full = list(target.shape)
            full[shard_dim] *= tp.size
            if list(tensor.shape) == full:
                n = target.shape[shard_dim]
                target.copy_(tensor.narrow(shard_dim, tp.rank * n, n))
                return
        expected = f"{tuple(target.shape)}"
        if shard_dim is not None and tp.size > 1:
            expected += f" (this rank's shard) or {tuple(full)} (full)"
        raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, expected {expected}")

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and also the weights' memory (level 2).

        After level 2 the parameters keep their identity and shape but hold no storage; the
        caller loads weights again after wake_up() (vLLM's semantics).
        """
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
        cache is allocated by the next generate())."""
        if self._weights_freed:
            for p in self._unique_parameters():
                p.data.untyped_storage().resize_(p.numel() * p.element_size())
            self._weights_freed = False
        self._asleep = False  # the KV cache comes back at the next generate()

    def _unique_parameters(self):
        return self.model.parameters()  # deduplicated: tied embeddings appear once

    # ---- generation ----

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete each prompt `params.n` times; outputs in prompt order. A prompt is a string
        (tokenized with the engine's tokenizer, special tokens added as the tokenizer does) or a
        list of token ids; one prompt may be given alone."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        prompt_token_ids = self._tokenize(prompts) if any(t is not None for t in texts) else prompts
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompt_token_ids)
        if len(sampling_params) != len(prompt_token_ids):
            raise ValueError(f"{len(sampling_params)} SamplingParams for {len(prompt_token_ids)} prompts")
        if self._asleep:
            raise RuntimeError("the engine is asleep: call wake_up() before generate()")
        if self._size_from_memory and self.runner.kv_cache is None:
            num_blocks = self._num_kv_blocks()   # memory free now: training state may have grown
            held = self.block_manager.num_blocks
            # shrink to fit; grow only for a real gain (a new block manager costs ~1 us a block)
            if num_blocks < held or num_blocks > held * 1.05:
                self._make_cache(num_blocks)
        self.block_manager.peak_used_blocks = self.block_manager.num_used_blocks
        self.scheduler.num_preemptions = 0
        bar = None
        try:
            requests = [self._add_request(i, list(p), sp)
                        for i, (p, sp) in enumerate(zip(prompt_token_ids, sampling_params))]
            if use_tqdm:
                bar = tqdm(total=sum(len(r) for r in requests), desc="generating", unit="seq")
            while not self.scheduler.is_finished():
                done, _ = self.step()
                if bar is not None and done:
                    bar.update(len(done))
        except BaseException:
            self.scheduler.abort_all()  # leave the engine usable: no blocks held, no stale prefixes
            self.block_manager.reset_prefix_cache()
            raise
        finally:
            if bar is not None:
                bar.close()
        tokenizer = self.tokenizer
        decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None \
            else (lambda ids: None)
        return [RequestOutput(seqs[0].request_id, seqs[0].token_ids[:seqs[0].num_prompt_tokens],
                              [CompletionOutput(s.sample_index, s.completion_token_ids, s.logprobs, s.finish_reason,
                                                decode(s.completion_token_ids))
                               for s in seqs], text)
                for seqs, text in zip(requests, texts)]

    def _tokenize(self, prompts) -> list[list[int]]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer: load the engine with LLM.from_pretrained(dir) from "
                             "a directory holding one, or pass tokenizer=...; or give token ids")
        return [tokenizer(p)["input_ids"] if isinstance(p, str) else p for p in prompts]

    def step(self) -> tuple[list[Sequence], bool]:
        """One engine step: schedule, run the model, append the sampled tokens.
        Returns (the sequences that finished, whether it was a prefill step)."""
        seqs, is_prefill = self.scheduler.schedule()
        seqs, tokens, logprobs = self.runner.step(seqs, is_prefill)
        return self.scheduler.postprocess(seqs, tokens, logprobs), is_prefill

    def _add_request(self, request_id: int, prompt: list[int], params: SamplingParams) -> list[Sequence]:
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
        return seqs

    def stats(self) -> dict:
        """KV usage of the last generate() call: blocks in the budget, peak blocks in use,
        preemptions."""
        bm = self.block_manager
        return {"num_kv_blocks": bm.num_blocks, "block_size": bm.block_size,
                "peak_used_blocks": bm.peak_used_blocks, "num_preemptions": self.scheduler.num_preemptions}
