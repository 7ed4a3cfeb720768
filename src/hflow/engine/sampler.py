"""Token sampling: greedy, temperature, top-k, top-p, per-sequence seeded streams, log-probs.

Every row draws one uniform u from its sequence's own `random.Random` stream and samples by
inverse CDF: the token is the first index i with cdf[i] > u * cdf[-1]. One draw per token,
independent of batch composition, so a seeded request gives the same tokens whatever else
is batched with it (and across tensor-parallel ranks, which run the same streams).

The returned log-prob is  log_softmax(logits / T)[token]  (T = temperature; raw logits when
T == 0) under the full distribution, before top-k / top-p filtering: the quantity an RL
trainer recomputes from its own forward pass (SamplingParams explains the choice).
"""
from __future__ import annotations

import torch

from hflow.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (fp32) -> (token ids [rows], log-probs [rows])."""
    params = seqs[0].params
    if params.top_k == 0 and params.top_p >= 1 and all(s.params is params for s in seqs):
        return _sample_plain(logits, seqs, params.temperature)
    rows, vocab = logits.shape
    device = logits.device
    temps = [s.params.temperature for s in seqs]
    temperature = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=logits.dtype, device=device)
    logp = torch.log_softmax(logits / temperature[:, None], dim=-1)
    tokens = torch.empty(rows, dtype=torch.long, device=device)

    greedy = [i for i, t in enumerate(temps) if t == 0]
    if greedy:
        idx = torch.tensor(greedy, device=device)
        tokens[idx] = logits[idx].argmax(dim=-1)

    plain = [i for i, s in enumerate(seqs) if temps[i] > 0 and s.params.top_k == 0 and s.params.top_p >= 1]
    if plain:
        idx = torch.tensor(plain, device=device)
        u = torch.tensor([seqs[i].rng.random() for i in plain], dtype=torch.float64, device=device)
        tokens[idx] = _inverse_cdf(logp[idx].exp(), u)

    filtered = [i for i, s in enumerate(seqs) if temps[i] > 0 and (s.params.top_k > 0 or s.params.top_p < 1)]
    if filtered:
        idx = torch.tensor(filtered, device=device)
        u = torch.tensor([seqs[i].rng.random() for i in filtered], dtype=torch.float64, device=device)
        top_k = torch.tensor([seqs[i].params.top_k or vocab for i in filtered], device=device)
        top_p = torch.tensor([seqs[i].params.top_p for i in filtered], dtype=logits.dtype, device=device)
        probs, order = logp[idx].exp().sort(dim=-1, descending=True)
        probs = probs * (torch.arange(vocab, device=device)[None, :] < top_k[:, None])
        # top-p on the top-k renormalised distribution: keep a token while the mass strictly
        # before it is below top_p (the most likely token is always kept)
        mass_before = (probs.cumsum(dim=-1) - probs) / probs.sum(dim=-1, keepdim=True)
        probs = probs * (mass_before < top_p[:, None])
        tokens[idx] = order.gather(1, _inverse_cdf(probs, u)[:, None])[:, 0]

    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _sample_plain(logits: torch.Tensor, seqs: list[Sequence], temperature: float):
    """The common case, one unfiltered SamplingParams for every row: the same tokens and
    log-probs as the general path, without its per-row index tensors."""
    logp = torch.log_softmax(logits if temperature in (0, 1) else logits / temperature, dim=-1)
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        u = torch.tensor([s.rng.random() for s in seqs], dtype=torch.float64, device=logits.device)
        tokens = _inverse_cdf(logp.exp(), u)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index i of each row with cdf[i] > u * cdf[-1]; zero-probability tokens are never
    chosen (their cdf step is empty). The cdf is summed in fp64 so that the tail of a large
    vocabulary keeps its mass."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp_(max=probs.shape[-1] - 1)
