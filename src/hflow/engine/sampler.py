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


def host_inputs(seqs: list[Sequence]) -> dict[str, list]:
    """What sample() needs from the host, one entry per row: `u`, one draw from the stream of
    each sampled row (0.0 for greedy rows, which draw nothing); and unless every row shares one
    unfiltered SamplingParams, `temperature` (0: greedy), `top_k` (0: off) and `top_p`.
    The model runner sends them with the step's other metadata, in one copy."""
    u = [s.rng.random() if s.params.temperature > 0 else 0.0 for s in seqs]
    if _shared_unfiltered(seqs):
        return {"u": u}
    return {"u": u, "temperature": [s.params.temperature for s in seqs],
            "top_k": [s.params.top_k for s in seqs], "top_p": [s.params.top_p for s in seqs]}


def _shared_unfiltered(seqs: list[Sequence]) -> bool:
    params = seqs[0].params
    return params.top_k == 0 and params.top_p >= 1 and all(s.params is params for s in seqs)


def sample(logits: torch.Tensor, seqs: list[Sequence], inputs: dict[str, torch.Tensor] | None = None,
           scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (fp32) -> (token ids [rows], log-probs [rows]).

    `inputs`: host_inputs(seqs) as tensors on the logits' device (u, temperature and top_p
    float64, top_k int64); None draws and sends them here. `scratch`: float64, at least rows x
    vocab elements, for the cdf (a caller that samples every step keeps one: on CPU a fresh
    one is pages to fault in, which at 32 rows of a 152k vocabulary took 5x the cumsum's own
    time). No step of this function waits for the device."""
    if inputs is None:
        inputs = {k: torch.tensor(v, dtype=torch.long if k == "top_k" else torch.float64, device=logits.device)
                  for k, v in host_inputs(seqs).items()}
    if "temperature" not in inputs:
        return _sample_plain(logits, inputs["u"], seqs[0].params.temperature, scratch)
    vocab = logits.shape[1]
    temps = inputs["temperature"]
    greedy = temps == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps).to(logits.dtype)[:, None], dim=-1)
    u = inputs["u"]
    # every row as a plain sample, then filtered and greedy rows replaced (a row's result
    # never depends on the other rows)
    tokens = _inverse_cdf(logp.exp(), u, scratch)
    if any(s.params.temperature > 0 and (s.params.top_k > 0 or s.params.top_p < 1) for s in seqs):
        top_k = torch.where(inputs["top_k"] > 0, inputs["top_k"], vocab)
        top_p = inputs["top_p"].to(logits.dtype)
        probs, order = logp.exp().sort(dim=-1, descending=True)
        probs = probs * (torch.arange(vocab, device=logits.device)[None, :] < top_k[:, None])
        # top-p on the top-k renormalised distribution: keep a token while the mass strictly
        # before it is below top_p (the most likely token is always kept)
        mass_before = (probs.cumsum(dim=-1) - probs) / probs.sum(dim=-1, keepdim=True)
        probs = probs * (mass_before < top_p[:, None])
        filtered = order.gather(1, _inverse_cdf(probs, u, scratch)[:, None])[:, 0]
        tokens = torch.where((top_k < vocab) | (top_p < 1), filtered, tokens)
    if any(s.params.temperature == 0 for s in seqs):
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _sample_plain(logits: torch.Tensor, u: torch.Tensor, temperature: float, scratch: torch.Tensor | None):
    """The common case, one unfiltered SamplingParams for every row: the same tokens and
    log-probs as the general path, with fewer ops."""
    logp = torch.log_softmax(logits if temperature in (0, 1) else logits / temperature, dim=-1)
    tokens = logits.argmax(dim=-1) if temperature == 0 else _inverse_cdf(logp.exp(), u, scratch)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """First index i of each row with cdf[i] > u * cdf[-1]; zero-probability tokens are never
    chosen (their cdf step is empty). The cdf is summed in fp64 so that the tail of a large
    vocabulary keeps its mass; in place, in `scratch` when given."""
    cdf = probs.double() if scratch is None else scratch[:probs.numel()].view(probs.shape).copy_(probs)
    cdf.cumsum_(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp_(max=probs.shape[-1] - 1)
