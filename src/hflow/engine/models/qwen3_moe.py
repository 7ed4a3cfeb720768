"""Qwen3-MoE: Qwen3's attention (llama.py) with a sparse mixture-of-experts MLP.

Each sparse layer's router (replicated) picks the top-k of E experts per token from an fp32
softmax, renormalised over the k when `norm_topk_prob` (transformers' Qwen3MoeTopKRouter);
the tokens are then grouped by expert (one stable sort) and each expert runs one matmul pair
over its rows. Layers in `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a
dense MLP of `intermediate_size`.

Tensor parallelism: every rank holds every expert, each sliced along its intermediate dim
(as Megatron's column/row split of a dense MLP): gate/up rows and down columns
[r*I/tp, (r+1)*I/tp); partial outputs meet in one all-reduce per layer, the same one a dense
MLP pays. The router is replicated, so all ranks pick the same experts with no extra
communication, and there is no load imbalance between ranks whatever the routing (expert
parallelism would trade that for an all-to-all of the tokens, worth it when the experts do
not fit on one device).

Routing is recorded: after a forward, `routed_experts` holds each token's chosen experts,
[tokens, moe layers, top_k] (int32), for routing replay in the trainer (model_runner.py
keeps it per KV slot).

Weights load from either format Hugging Face writes: per-expert
`mlp.experts.{j}.{gate,up,down}_proj.weight` (what save_pretrained writes in transformers 5)
or the fused `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I] (the
in-memory parameters, which a trainer's weight sync sends).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hflow.engine.models.layers import RMSNorm, TPInfo, _param
from hflow.engine.models.llama import _ACTIVATIONS, MLP, ArchSpec, Attention, CausalLM


def is_sparse_layer(cfg, layer: int) -> bool:
    """transformers' rule: sparse unless listed in mlp_only_layers or off the sparse step."""
    return (layer not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
            and (layer + 1) % cfg.decoder_sparse_step == 0)


def moe_layers(cfg) -> list[int]:
    """The indices of the config's sparse (MoE) layers."""
    return [i for i in range(cfg.num_hidden_layers) if is_sparse_layer(cfg, i)]


def route(router_logits: torch.Tensor, top_k: int, normalise: bool, dtype: torch.dtype):
    """(weights [T, k] in `dtype`, experts [T, k]) as Qwen3MoeTopKRouter: fp32 softmax, top-k,
    renormalised over the k if `normalise`."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(dtype), experts


class SparseMoE(nn.Module):
    def __init__(self, cfg, tp: TPInfo, dtype, device):
        super().__init__()
        experts, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if inter % tp.size:
            raise ValueError(f"moe_intermediate_size {inter} does not divide by tensor-parallel size {tp.size}")
        if not 0 < cfg.num_experts_per_tok <= experts:
            raise ValueError(f"num_experts_per_tok {cfg.num_experts_per_tok} must be in [1, {experts}]")
        if cfg.hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(f"activation {cfg.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}")
        self.tp, self.num_experts, self.top_k = tp, experts, cfg.num_experts_per_tok
        self.normalise = bool(cfg.norm_topk_prob)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        local = inter // tp.size
        self.router = _param(experts, hidden, dtype=dtype, device=device)
        self.gate_up = _param(experts, 2, local, hidden, dtype=dtype, device=device)   # [gate; up] of each expert
        self.down = _param(experts, hidden, local, dtype=dtype, device=device)
        self.routed_experts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(F.linear(x, self.router), self.top_k, self.normalise, x.dtype)
        self.routed_experts = experts
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)       # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows, scale = x[tokens], weights.flatten()[order, None]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                gate, up = F.linear(rows[start:start + n], self.gate_up[e].flatten(0, 1)).chunk(2, dim=-1)
                outs.append(F.linear(self.act(gate) * up, self.down[e]))
            start += n
        out = torch.zeros_like(x)
        if outs:
            out.index_add_(0, tokens, torch.cat(outs) * scale)
        return self.tp.all_reduce(out)


class MoEDecoderLayer(nn.Module):
    def __init__(self, cfg, spec: ArchSpec, layer: int, tp: TPInfo, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, spec, layer, tp, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = SparseMoE(cfg, tp, dtype, device) if is_sparse_layer(cfg, layer) else MLP(cfg, spec, tp, dtype, device)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeCausalLM(CausalLM):
    """CausalLM with sparse MoE layers; `routed_experts` after each forward."""

    def __init__(self, cfg, max_len: int, tp: TPInfo | None = None, dtype=torch.float32, device="cpu"):
        if getattr(cfg, "use_sliding_window", False):
            raise NotImplementedError("Qwen3-MoE with use_sliding_window is not supported")
        super().__init__(cfg, max_len, tp, dtype, device)
        self.moe_layers = moe_layers(cfg)
        self.top_k = cfg.num_experts_per_tok

    def make_layer(self, cfg, spec, layer, tp, dtype, device) -> nn.Module:
        return MoEDecoderLayer(cfg, spec, layer, tp, dtype, device)

    @property
    def routed_experts(self) -> torch.Tensor:
        """[tokens, moe layers, top_k] int32: the experts the last forward chose."""
        return torch.stack([self.layers[i].mlp.routed_experts for i in self.moe_layers], dim=1).to(torch.int32)

    def mlp_targets(self, prefix: str, mlp: nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
        if not isinstance(mlp, SparseMoE):
            return super().mlp_targets(prefix, mlp)
        t = {prefix + "gate.weight": (mlp.router.detach(), None),
             prefix + "experts.gate_up_proj": (mlp.gate_up.detach(), 2),
             prefix + "experts.down_proj": (mlp.down.detach(), 2)}
        for j in range(mlp.num_experts):
            t[prefix + f"experts.{j}.gate_proj.weight"] = (mlp.gate_up.detach()[j, 0], 0)
            t[prefix + f"experts.{j}.up_proj.weight"] = (mlp.gate_up.detach()[j, 1], 0)
            t[prefix + f"experts.{j}.down_proj.weight"] = (mlp.down.detach()[j], 1)
        return t

    def as_stored(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The fused [E, 2I, H] gate_up_proj (full or this rank's shard) as [E, 2, I, H]."""
        if name.endswith("experts.gate_up_proj"):
            return tensor.unflatten(1, (2, tensor.shape[1] // 2))
        return tensor
