"""Engine options (the keywords of LLM(...) / LLM.from_pretrained(...))."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_KV_CACHE_BYTES = 1 << 30  # the default budget on CPU


@dataclass
class EngineConfig:
    """
    block_size: tokens per KV block (the unit of allocation and of prefix sharing).
    num_kv_blocks / kv_cache_bytes: the KV budget, in blocks or in bytes for all layers on this
        rank (give at most one). Default: what max_num_seqs sequences of max_model_len need,
        capped on CPU at 1 GiB, on a GPU by gpu_memory_fraction. The cache is allocated by the
        first step, freed by sleep() and allocated again by the first step after wake_up().
    gpu_memory_fraction: without an explicit budget on a GPU, the share of the device's memory
        the engine may fill: the cache gets fraction * total - (memory in use) - (a step's
        activations), measured each time it is allocated (so after the weights are in, and
        beside whatever training state the process holds; the budget shrinks when it must and
        grows only by more than 5 %), as vLLM's gpu_memory_utilization. Ignored on CPU.
    max_num_seqs: sequences running at once (a decode step's batch).
    max_num_batched_tokens: new tokens in one prefill step (one longer prompt still runs alone).
    max_model_len: longest prompt + completion; default: the config's max_position_embeddings.
    enable_prefix_caching: share KV blocks of identical prefixes (the n samples of a prompt).
    tp_group: a torch.distributed process group to shard the model over (tensor parallel);
        every rank of it must add the same requests and step alike (generate() with the same
        arguments).
    """
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    tp_group: dist.ProcessGroup | None = None
    gpu_memory_fraction: float = 0.9

    def __post_init__(self):
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_bytes, not both")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")


def kv_blocks_for_memory(total: int, used: int, fraction: float, block_bytes: int, headroom: int = 0) -> int:
    """KV blocks that fit when the device may be filled to `fraction` of its `total` bytes:

        blocks = floor((fraction * total - used - headroom) / block_bytes)

    `used`: bytes held now that the cache cannot take (this process's tensors, weights
    included, and other processes'; not the caching allocator's free cached bytes, which the
    cache reuses); `headroom`: a step's transient memory (step_activation_bytes). Raises
    ValueError, with the figures, when not one block fits."""
    blocks = int(fraction * total - used - headroom) // block_bytes
    if blocks < 1:
        gib = 1 << 30
        raise ValueError(
            f"no KV-cache block ({block_bytes} bytes) fits: {fraction:g} x {total / gib:.2f} GiB of device "
            f"memory minus {used / gib:.2f} GiB in use and {headroom / gib:.2f} GiB for a step's activations "
            f"leaves {(fraction * total - used - headroom) / gib:.2f} GiB; raise gpu_memory_fraction "
            "(--rollout.gpu-memory-fraction), free memory, or give kv_cache_bytes")
    return blocks


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, used) bytes of a CUDA device, `used` as kv_blocks_for_memory means it: what is
    not free on the device, less what this process's caching allocator holds unused."""
    free, total = torch.cuda.mem_get_info(device)
    cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return total, total - free - cached_unused


def step_activation_bytes(hf_config, max_num_batched_tokens: int, max_num_seqs: int, elem: int) -> int:
    """A generous bound on one step's transient memory: a layer's widest activations for
    max_num_batched_tokens tokens (q/k/v, gate/up and their product, a few hidden-sized
    tensors; a layer's are freed before the next) and the sampler's fp32 / fp64 copies of
    max_num_seqs vocabulary-sized rows (logits, log-probs, probabilities, their fp64 cdf:
    32 bytes an entry)."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    per_token = (heads + 2 * kv_heads) * head_dim + 3 * hf_config.intermediate_size + 4 * hf_config.hidden_size
    return max_num_batched_tokens * per_token * elem + max_num_seqs * hf_config.vocab_size * 32
