"""Engine options (the keywords of LLM(...) / LLM.from_pretrained(...))."""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass
class EngineConfig:
    """
    block_size: tokens per KV block (the unit of allocation and of prefix sharing).
    num_kv_blocks / kv_cache_bytes: the KV budget, in blocks or in bytes for all layers on this
        rank (give at most one). Default: what max_num_seqs sequences of max_model_len need,
        capped at 1 GiB. The cache is allocated (zeroed) by the first generate(), freed by
        sleep() and allocated again by the first generate() after wake_up().
    max_num_seqs: sequences running at once (a decode step's batch).
    max_num_batched_tokens: new tokens in one prefill step (one longer prompt still runs alone).
    max_model_len: longest prompt + completion; default: the config's max_position_embeddings.
    enable_prefix_caching: share KV blocks of identical prefixes (the n samples of a prompt).
    tp_group: a torch.distributed process group to shard the model over (tensor parallel);
        every rank of it must call generate() with the same arguments.
    """
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    tp_group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_bytes, not both")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
