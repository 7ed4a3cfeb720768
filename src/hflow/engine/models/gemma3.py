"""Gemma 3 text models (transformers' Gemma3ForCausalLM, model_type "gemma3_text") over a flat batch.

Built from llama.py's pieces (fused tensor-parallel q/k/v and gate/up, paged attention); what
Gemma 3 does differently, each as transformers does it:
- RMSNorm scales by (1 + w), in fp32, and casts back after the scale (Gemma3RMSNorm);
- four norms per layer: the attention's and the MLP's outputs are normed before the residual add;
- q/k norms, attention scale query_pre_attn_scalar ** -0.5;
- layer_types: sliding-window and full-attention layers, each type with its own rope
  (rope_parameters[layer_type]);
- embeddings times sqrt(hidden_size), the factor rounded to the embedding's dtype first;
- GeGLU MLP (hidden_activation, gelu_pytorch_tanh); tied LM head; final_logit_softcapping.
"""
from __future__ import annotations

import torch
from torch import nn

from hflow.engine.attention import AttentionMetadata
from hflow.engine.models.layers import (ColumnParallelLinear, RotaryEmbedding, RowParallelLinear, TPInfo, linear)
from hflow.engine.models.llama import _ACTIVATIONS, ArchSpec, Attention, CausalLM

SLIDING, FULL = "sliding_attention", "full_attention"


def check_supported(cfg) -> None:
    """Refuse the Gemma 3 options this engine would get wrong, each with the reason."""
    if getattr(cfg, "use_bidirectional_attention", False):
        raise NotImplementedError("gemma3_text with use_bidirectional_attention (an encoder) cannot generate; "
                                  "hflow's engine runs causal models only")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        # transformers' Gemma3Attention does not pass it to its attention function: which one
        # would be the reference is not clear, so neither is guessed
        raise NotImplementedError("gemma3_text with attn_logit_softcapping set is not supported (transformers' "
                                  "Gemma 3 attention does not apply it); set it to None")
    unknown = set(cfg.layer_types) - {SLIDING, FULL}
    if unknown:
        raise NotImplementedError(f"gemma3_text layer types {sorted(unknown)}; supported: {SLIDING}, {FULL}")
    if cfg.hidden_activation not in _ACTIVATIONS:
        raise NotImplementedError(f"activation {cfg.hidden_activation!r}; supported: {sorted(_ACTIVATIONS)}")


class GemmaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + w) in fp32, cast to x's dtype at the end (Gemma3RMSNorm:
    unlike Llama's, the weight multiplies before the cast). The checkpoint's w is stored as it is."""

    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(Attention):
    """Llama's fused, paged attention with Gemma's q/k norms and query_pre_attn_scalar scale."""

    def __init__(self, cfg, spec: ArchSpec, layer: int, tp: TPInfo, dtype, device):
        super().__init__(cfg, spec, layer, tp, dtype, device)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)


class GeGLU(nn.Module):
    def __init__(self, cfg, tp: TPInfo, dtype, device):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], False, tp, dtype, device)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp, dtype, device)
        self.act = _ACTIVATIONS[cfg.hidden_activation]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, spec: ArchSpec, layer: int, tp: TPInfo, dtype, device):
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)  # noqa: E731
        self.layer_type = cfg.layer_types[layer]
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma3Attention(cfg, spec, layer, tp, dtype, device)
        self.mlp = GeGLU(cfg, tp, dtype, device)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def gemma3_spec(cfg) -> ArchSpec:
    bias = bool(getattr(cfg, "attention_bias", False))
    return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                    windows=[cfg.sliding_window if t == SLIDING else None for t in cfg.layer_types])


class Gemma3CausalLM(CausalLM):
    """CausalLM's interface (forward, compute_logits, pack_weights, weight_targets) for Gemma 3."""

    def __init__(self, cfg, max_len: int, tp: TPInfo | None = None, dtype=torch.float32, device="cpu"):
        nn.Module.__init__(self)   # CausalLM.__init__ would build Llama layers: only its methods are shared
        check_supported(cfg)
        tp = tp or TPInfo()
        self.config, self.tp = cfg, tp
        spec = gemma3_spec(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device))
        self.embed_tokens.weight.requires_grad_(False)
        # transformers rounds sqrt(hidden) to the weight's dtype before multiplying (25.25 in bf16 at 640)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5).to(dtype=dtype, device=device),
                             persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, spec, i, tp, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(cfg, max_len, dtype, device, layer_type=t)
                                     for t in sorted(set(cfg.layer_types))})
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)
        self.lm_head_packed: torch.Tensor | None = None
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                                           device=device), requires_grad=False)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        rope = {t: r(positions) for t, r in self.rotary.items()}
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, *rope[layer.layer_type], meta, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head_weight, None, self.lm_head_packed)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        t = super().weight_targets()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            t[p + "pre_feedforward_layernorm.weight"] = (layer.pre_feedforward_layernorm.weight.detach(), None)
            t[p + "post_feedforward_layernorm.weight"] = (layer.post_feedforward_layernorm.weight.detach(), None)
        return t
