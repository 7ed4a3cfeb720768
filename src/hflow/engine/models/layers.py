"""Building blocks: tensor-parallel linears (as gpt-fast / Megatron), RMSNorm, rotary embedding.

Parameters are allocated with `torch.empty` (no initialisation): weights always arrive
through `load_weights`, so building a model costs no compute and no second copy.

Tensor parallelism over a process group of size tp:
- column-parallel (q/k/v, gate/up): each rank holds a contiguous chunk of the output rows;
- row-parallel (o_proj, down_proj): each rank holds a contiguous chunk of the input columns
  and the partial products are summed with one all-reduce (the bias is added once, after);
- norms, embeddings and lm_head are replicated (the vocabulary is not sharded).

Packed weights (CPU, fp32, and bf16 where the CPU has bf16 instructions): MKL's matmul is
slow for the few rows of a small decode batch (8 rows cost about as much as 32). oneDNN's, on a
weight reordered once into its blocked layout, is 25-40 % faster for 4-16 rows and ~10 % for 32
(fp32, a 25M model, 1-2 threads); in bf16 at Qwen3-0.6B's shapes (AVX512-BF16, 1 thread) 40-60 %
faster for 4-8 rows and 15-25 % for 32, the LM head included. Once a model is packed every matmul
uses the copy, down to one row: at 1-3 rows it is 2.2-2.9x faster than F.linear in bf16 (0.6B's
layers; 1.3x the LM head) and 2-4x in fp32 at 2-3 rows, level at 1 (a 25M model's layers and
Qwen3's LM head, 1 thread), which is the tail of a batch whose responses end at different lengths.
A row's result does not depend on the batch size. The linears' `packed` holds that copy while
the model runner wants it (CausalLM.pack_weights).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class TPInfo:
    """The tensor-parallel group this model is sharded over (size 1 when there is none)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


def _param(*shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def cpu_bf16_instructions() -> str | None:
    """The CPU's bf16 matmul instructions oneDNN uses ("AMX": Intel Sapphire Rapids and later;
    "AVX512-BF16": Intel Cooper Lake, AMD Zen 4 and later), or None where bf16 is emulated."""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    return None


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed matmul is available for this weight (bf16: only with the CPU's
    bf16 instructions; elsewhere oneDNN emulates bf16)."""
    fast_dtype = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_bf16_instructions() is not None)
    return (weight.device.type == "cpu" and fast_dtype and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a [out, in] weight (tuned for batches of ~32 rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, on the packed copy of W when there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split into `sections` (fused projections); each
    section is chunked across the tp ranks, so rank r holds rows [r*s/tp, (r+1)*s/tp) of each."""

    def __init__(self, in_features: int, sections: list[int], bias: bool, tp: TPInfo, dtype, device):
        super().__init__()
        for s in sections:
            if s % tp.size:
                raise ValueError(f"output size {s} does not divide by tensor-parallel size {tp.size}")
        self.local_sections = [s // tp.size for s in sections]
        self.weight = _param(sum(self.local_sections), in_features, dtype=dtype, device=device)
        self.bias = _param(sum(self.local_sections), dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None

    def section(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        """A view of section i's local rows of `tensor` (the weight or the bias)."""
        start = sum(self.local_sections[:i])
        return tensor.detach()[start:start + self.local_sections[i]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: rank r holds input columns [r*in/tp, (r+1)*in/tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo, dtype, device):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} does not divide by tensor-parallel size {tp.size}")
        self.tp = tp
        self.weight = _param(out_features, in_features // tp.size, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 as transformers does (for fp32
    inputs F.rms_norm, one call, gives the same bits; for 16-bit ones it casts differently)."""

    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.shape = (dim,)
        self.weight = _param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(hf_config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale of the config's RoPE (default, linear, llama3, yarn...).

    Non-default types use transformers' own ROPE_INIT_FUNCTIONS so that scaled variants match
    the reference exactly; types that depend on the running sequence length are refused.
    `layer_type`: the rope of that layer type, for configs whose rope_parameters hold one per
    type (Gemma 3: "sliding_attention" and "full_attention").
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if layer_type is not None:
        if layer_type not in params:
            raise ValueError(f"rope_parameters has no entry for layer type {layer_type!r}: {sorted(params)}")
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    if rope_type in ("dynamic", "longrope"):
        raise NotImplementedError(f"rope type {rope_type!r} (sequence-length dependent) is not supported; "
                                  "supported: default, linear, llama3, yarn")
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(f"unknown rope type {rope_type!r}")
    by_type = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **by_type)
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_len), looked up once per step for every layer.

    transformers computes x * cos + rotate_half(x) * sin with cos = cat(f, f).cos() * scale and
    rotate_half(x) = cat(-x2, x1). The same bits come from roll(x) = cat(x2, x1) times a sin
    table whose first half is negated, in fewer ops: so `sin` here is cat(-sin f, sin f).
    """

    def __init__(self, hf_config, max_len: int, dtype, device, layer_type: str | None = None):
        super().__init__()
        inv_freq, scale = rope_inv_freq(hf_config, layer_type)
        freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(dtype=dtype, device=device), persistent=False)
        sin = emb.sin() * scale
        sin[:, :inv_freq.numel()] *= -1
        self.register_buffer("sin", sin.to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens] -> cos, sin of shape [tokens, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim]; pairs dim i with dim i + head_dim/2 (`sin` as
    RotaryEmbedding gives it, its first half negated)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
