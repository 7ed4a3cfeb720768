"""Per-token log-probs (and entropy) from logits, in chunks that bound the fp32 buffers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, chunk_rows: int = 1024):
    """log pi(token) = log_softmax(logits / T)[token], T = 1 when temperature is 0 (greedy);
    entropy H = -sum_v p_v log p_v of the same distribution. Computed in fp32, `chunk_rows`
    positions at a time: the fp32 [rows, vocab] buffers exist for one chunk only, in the backward
    too (each chunk is recomputed there rather than stored), so a 152k vocabulary costs
    ~0.6 GB per buffer instead of batch x length x vocab x 4 bytes."""
    # split, not slicing: one backward node gathers the chunks' gradients into one tensor,
    # where each slice would add a full-size gradient of its own
    chunks = list(zip(logits.split(chunk_rows), tokens.split(chunk_rows))) or [(logits, tokens)]
    recompute = torch.is_grad_enabled() and logits.requires_grad and len(chunks) > 1
    parts = [checkpoint(_chunk_log_probs, x, t, temperature, with_entropy, use_reentrant=False)
             if recompute else _chunk_log_probs(x, t, temperature, with_entropy) for x, t in chunks]
    logp = torch.cat([p for p, _ in parts])
    entropy = torch.cat([e for _, e in parts]) if with_entropy else None
    return logp, entropy


def _chunk_log_probs(logits, tokens, temperature, with_entropy):
    logits = logits.float()
    if temperature not in (0, 1):
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy
