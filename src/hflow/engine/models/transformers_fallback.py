"""Any decoder transformers runs, inside the engine: the family's own `transformers` model with
its attention routed to the paged KV cache.

The engine's fast classes (MODEL_CLASSES) fuse q/k/v and gate/up, pack their weights for
oneDNN and shard over tensor-parallel ranks; a family without one still generates here, behind
the same LLM interface (continuous batching, prefix caching, weights loaded in place, sleep),
because everything the family does differently (norms, rotary variants, biases, activations)
stays in transformers' code. Only attention is ours: the model is built with the attention
implementation registered below, which receives each layer's rotated q/k and v, writes k/v to
that layer's paged cache and attends through it (hflow.engine.attention.paged_attention), so
the engine's scheduler, block tables and sampler are unchanged.

What it costs: one matmul per projection (no fusion, no packed copies) and no tensor
parallelism. What it cannot run: a model whose attention does not go through transformers'
attention interface (state-space and linear-attention layers) or that soft-caps attention
scores (Gemma 2): refused when built, with the reason.
"""
from __future__ import annotations

import copy
import sys

import torch
import transformers
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.initialization import no_init_weights
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hflow.engine.attention import AttentionMetadata, paged_attention
from hflow.engine.models.layers import TPInfo

PAGED_ATTENTION = "hflow_paged"


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, softcap=None, hflow_paged=None, **kwargs):
    """transformers' attention-function signature over the engine's paged cache: query
    [1, H, T, D], key/value [1, H_kv, T, D] (rotated and normed by the model's own code) ->
    ([1, T, H, D], None)."""
    if hflow_paged is None:
        raise RuntimeError(f"a model with attention {PAGED_ATTENTION!r} runs inside hflow.engine only")
    if softcap is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by the paged attention")
    meta, kv_caches = hflow_paged
    k_cache, v_cache = kv_caches[module.layer_idx]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))   # [T, heads, D]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = paged_attention(q, k.contiguous(), v.contiguous(), k_cache, v_cache, meta, scale, sliding_window)
    return out[None], None


def register_paged_attention() -> str:
    """Make PAGED_ATTENTION a transformers attention implementation (idempotent). The cache's
    block tables replace the mask, so transformers builds none."""
    AttentionInterface.register(PAGED_ATTENTION, _paged_attention)
    AttentionMaskInterface.register(PAGED_ATTENTION, lambda *args, **kwargs: None)
    return PAGED_ATTENTION


class _KVShape(nn.Module):
    """What the model runner reads of a layer's attention to size the cache."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim


class _Layer(nn.Module):
    def __init__(self, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.self_attn = _KVShape(num_kv_heads, head_dim)


class TransformersCausalLM(nn.Module):
    """The engine-model interface of CausalLM (forward over a flat batch with AttentionMetadata,
    compute_logits, pack_weights, weight_targets, `layers` for the cache's shape) around a
    transformers causal LM built from `cfg`."""

    def __init__(self, cfg, max_len: int, tp: TPInfo | None = None, dtype=torch.float32, device="cpu"):
        super().__init__()
        tp = tp or TPInfo()
        if tp.size > 1:
            raise ValueError(f"model_type {cfg.model_type!r} runs on transformers' own model in the engine, "
                             "which has no tensor parallelism: use --rollout.tp-size 1")
        if getattr(cfg, "attn_logit_softcapping", None):
            raise NotImplementedError(f"model_type {cfg.model_type!r} soft-caps attention scores "
                                      f"(attn_logit_softcapping={cfg.attn_logit_softcapping}), which the engine's "
                                      "paged attention does not do")
        self.config, self.tp = cfg, tp
        try:
            # weights arrive through load_weights, as for the fast classes: no random init
            with torch.device(device), no_init_weights():
                # a copy: transformers records the attention implementation on the config it is given
                self.hf = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dtype, attn_implementation=register_paged_attention())
        except ValueError as e:   # transformers: this family does not take a custom attention function
            raise NotImplementedError(f"model_type {cfg.model_type!r} cannot run in hflow.engine: {e}") from e
        # no_init_weights skips the tying too: a tied head would stay an untouched, unloaded copy
        self.hf.tie_weights()
        self.hf.eval().requires_grad_(False)
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = text_cfg.num_attention_heads
        kv_heads = getattr(text_cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
        self.layers = nn.ModuleList(_Layer(kv_heads, head_dim) for _ in range(text_cfg.num_hidden_layers))
        self.embed_tokens = self.hf.get_input_embeddings()
        self.lm_head_weight = self.hf.get_output_embeddings().weight
        self.final_softcap = getattr(text_cfg, "final_logit_softcapping", None)
        self.logit_scale = getattr(text_cfg, "logit_scale", None)          # Cohere: logits * scale
        self.logits_scaling = getattr(text_cfg, "logits_scaling", None)    # Granite: logits / scaling

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """[tokens] ids and positions -> final hidden states [tokens, hidden]."""
        out = self.hf.get_decoder()(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                    hflow_paged=(meta, kv_caches))
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf.get_output_embeddings()(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def pack_weights(self, on: bool = True) -> bool:
        return False   # transformers' linears run as they are

    def weight_targets(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """Hugging Face name -> (the parameter's storage, no tensor-parallel dim)."""
        return {name: (t.detach(), None) for name, t in self.hf.state_dict(keep_vars=True).items()}


def why_not_runnable(model_type: str | None) -> str | None:
    """Why transformers' model of this family cannot run in the engine (and be trained with
    hflow's packed attention), or None if it can: it must be a causal LM of transformers whose
    attention goes through the attention interface."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        return f"transformers {transformers.__version__} has no causal LM for model_type {model_type!r}"
    model_class = getattr(transformers, name, None)
    if model_class is None or not getattr(model_class, "_supports_attention_backend", False):
        return (f"transformers' {name} does not route its attention through transformers' attention interface "
                "(state-space, recurrent or hybrid layers, or an older implementation), which the engine's paged KV "
                "cache and the trainer's packed sequences need")
    return None


_NOTIFIED: set[str] = set()


def fallback_notice(model_type: str, fast) -> str:
    return (f"hflow.engine: model_type {model_type!r} generates on transformers' own model (slower: unfused, "
            f"unpacked matmuls, no tensor parallelism); the fast engine runs {', '.join(fast)}")


def say_fallback(model_type: str, fast) -> None:
    """One line on stderr, once a process and family."""
    if model_type not in _NOTIFIED:
        _NOTIFIED.add(model_type)
        print(fallback_notice(model_type, fast), file=sys.stderr, flush=True)
