"""The Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a flat batch of tokens.

All sequences of a step are packed into one [tokens, hidden] tensor (no padding); attention
is the only place that knows about sequences, through AttentionMetadata. The four
architectures differ only in a few switches:

    model_type  q/k/v bias         o bias          q/k RMSNorm  sliding window
    llama       attention_bias     attention_bias  -            -
    qwen2       yes                no              -            per layer (layer_types)
    qwen3       attention_bias     attention_bias  yes          per layer (layer_types)
    mistral     no                 no              -            sliding_window, every layer
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hflow.engine.attention import AttentionMetadata, paged_attention
from hflow.engine.models.layers import (ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                        TPInfo, apply_rope, can_pack, linear, pack)

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class ArchSpec:
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    windows: list[int | None]  # sliding window of each layer (None: full attention)


def arch_spec(cfg) -> ArchSpec:
    kind = cfg.model_type
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    layer_types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if layer_types:
        windows = [window if t == "sliding_attention" else None for t in layer_types]
    else:
        windows = [window if kind == "mistral" else None] * cfg.num_hidden_layers
    return ArchSpec(
        qkv_bias=True if kind == "qwen2" else attention_bias,
        o_bias=False if kind == "qwen2" else attention_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        windows=windows)


class Attention(nn.Module):
    def __init__(self, cfg, spec: ArchSpec, layer: int, tp: TPInfo, dtype, device):
        super().__init__()
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if cfg.num_attention_heads % tp.size or cfg.num_key_value_heads % tp.size:
            raise ValueError(f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads "
                             f"do not divide by tensor-parallel size {tp.size}")
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = cfg.num_key_value_heads // tp.size
        self.scale = self.head_dim ** -0.5
        self.window = spec.windows[layer]
        q_size, kv_size = cfg.num_attention_heads * self.head_dim, cfg.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_size, kv_size, kv_size],
                                             spec.qkv_bias, tp, dtype, device)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, spec.o_bias, tp, dtype, device)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        n, h, kv_h, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(n, h + 2 * kv_h, d)
        v = qkv[:, h + kv_h:]
        if self.q_norm is None:  # q and k rotated in one go
            qk = apply_rope(qkv[:, :h + kv_h], cos, sin)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = apply_rope(self.q_norm(qkv[:, :h]), cos, sin)
            k = apply_rope(self.k_norm(qkv[:, h:h + kv_h]), cos, sin)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg, spec: ArchSpec, tp: TPInfo, dtype, device):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], spec.mlp_bias, tp, dtype, device)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, spec.mlp_bias, tp, dtype, device)
        if cfg.hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(f"activation {cfg.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, spec, layer, tp, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, spec, layer, tp, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, spec, tp, dtype, device)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and lm_head, with Hugging Face parameter names
    mapped onto fused, tensor-parallel storage by `weight_targets`."""

    def __init__(self, cfg, max_len: int, tp: TPInfo | None = None, dtype=torch.float32, device="cpu"):
        super().__init__()
        tp = tp or TPInfo()
        self.config, self.tp = cfg, tp
        spec = arch_spec(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.make_layer(cfg, spec, i, tp, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(cfg, max_len, dtype, device)
        self.lm_head_packed: torch.Tensor | None = None
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                                           device=device), requires_grad=False)

    def make_layer(self, cfg, spec: ArchSpec, layer: int, tp: TPInfo, dtype, device) -> nn.Module:
        """Decoder layer `layer` (a family whose MLP differs, as Qwen3-MoE's, overrides this)."""
        return DecoderLayer(cfg, spec, layer, tp, dtype, device)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """[tokens] ids and positions -> final hidden states [tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head_weight, None, self.lm_head_packed)

    def pack_weights(self, on: bool = True) -> bool:
        """Give every matmul a packed copy of its weight (layers.py), or drop them (on=False).
        Returns whether the model's matmuls are now packed."""
        on = on and can_pack(self.lm_head_weight)
        for m in self.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.packed = pack(m.weight) if on else None
        self.lm_head_packed = pack(self.lm_head_weight) if on else None
        return on

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """Hugging Face name -> (view of our storage, tensor-parallel shard dim or None)."""
        t: dict[str, tuple[torch.Tensor, int | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens.weight.detach(), None),
            "model.norm.weight": (self.norm.weight.detach(), None),
            "lm_head.weight": (self.lm_head_weight.detach(), None),
        }
        for i, layer in enumerate(self.layers):
            p, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
            t[p + "input_layernorm.weight"] = (layer.input_layernorm.weight.detach(), None)
            t[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight.detach(), None)
            for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
                t[p + f"self_attn.{name}.weight"] = (attn.qkv_proj.section(attn.qkv_proj.weight, j), 0)
                if attn.qkv_proj.bias is not None:
                    t[p + f"self_attn.{name}.bias"] = (attn.qkv_proj.section(attn.qkv_proj.bias, j), 0)
            t[p + "self_attn.o_proj.weight"] = (attn.o_proj.weight.detach(), 1)
            if attn.o_proj.bias is not None:
                t[p + "self_attn.o_proj.bias"] = (attn.o_proj.bias.detach(), None)
            if attn.q_norm is not None:
                t[p + "self_attn.q_norm.weight"] = (attn.q_norm.weight.detach(), None)
                t[p + "self_attn.k_norm.weight"] = (attn.k_norm.weight.detach(), None)
            t.update(self.mlp_targets(p + "mlp.", mlp))
        return t

    def mlp_targets(self, prefix: str, mlp: nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
        """weight_targets' entries of one layer's MLP (names under `prefix`)."""
        t: dict[str, tuple[torch.Tensor, int | None]] = {}
        for j, name in enumerate(("gate_proj", "up_proj")):
            t[prefix + f"{name}.weight"] = (mlp.gate_up_proj.section(mlp.gate_up_proj.weight, j), 0)
            if mlp.gate_up_proj.bias is not None:
                t[prefix + f"{name}.bias"] = (mlp.gate_up_proj.section(mlp.gate_up_proj.bias, j), 0)
        t[prefix + "down_proj.weight"] = (mlp.down_proj.weight.detach(), 1)
        if mlp.down_proj.bias is not None:
            t[prefix + "down_proj.bias"] = (mlp.down_proj.bias.detach(), None)
        return t
