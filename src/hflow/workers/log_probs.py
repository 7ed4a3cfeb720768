"""Per-token log-probs (and entropy) from logits, in chunks that bound the fp32 buffers."""
from __future__ import annotations

import torch


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, chunk_rows: int = 256, grad_into_logits: bool = False):
    """log pi(token) = log_softmax(logits / T)[token], T = 1 when temperature is 0 (greedy);
    entropy H = -sum_v p_v log p_v of the same distribution. Computed in fp32, `chunk_rows`
    positions at a time: the fp32 [rows, vocab] buffer exists for one chunk only, in the backward
    too, so a 152k vocabulary costs ~0.16 GB instead of batch x length x vocab x 4 bytes (as
    fast as chunks of 1024 rows at Qwen3's head on one thread, and 0.47 GB less held while
    the head's backward runs). The backward rebuilds each chunk's softmax from the log-sum-exp
    the forward kept (one pass, where autograd would recompute the log-softmax, run its
    backward, and scatter the gathered gradient into zeros).

    grad_into_logits: the backward writes the logits' gradient over the logits themselves,
    chunk by chunk once each is read, instead of into a new [rows, vocab] buffer (0.2-0.3 GB
    at Qwen3-0.6B's head, fresh pages on CPU, while the head's backward runs). For
    logits the caller does not read after the backward and that are not a leaf; an op that saved
    them for its own backward (a soft-cap's tanh) makes autograd raise its in-place error."""
    if grad_into_logits and logits.grad_fn is None:
        raise ValueError("grad_into_logits would overwrite a leaf tensor's values: the caller's own")
    scale = 1.0 if temperature in (0, 1) else 1.0 / temperature
    return _ChunkedLogProbs.apply(logits, tokens, scale, chunk_rows, with_entropy, grad_into_logits)


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, scale, chunk_rows, with_entropy, grad_into_logits):
        rows = logits.shape[0]
        logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        # one fp32 chunk for every chunk, forward and backward: on CPU each fresh 0.6 GB buffer
        # is pages the kernel must fault in and zero again (~0.3 s per 0.6 GB)
        scratch = logits.new_empty((min(rows, chunk_rows), logits.shape[1]), dtype=torch.float32)
        for start in range(0, rows, chunk_rows):
            part = slice(start, start + chunk_rows)
            x = scratch[:logits[part].shape[0]].copy_(logits[part])    # worked on in place below
            if scale != 1.0:
                x.mul_(scale)
            picked = x.gather(-1, tokens[part, None]).squeeze(-1)
            peak = x.amax(dim=-1)
            shifted = x.sub_(peak[:, None])                 # <= 0: exp cannot overflow
            if with_entropy:   # H = log Z - sum_v p_v x_v, with x shifted, Z = sum_v exp(x_v)
                e = shifted.exp()
                z = e.sum(-1)
                entropy[part] = z.log() - e.mul_(shifted).sum(-1) / z
            else:
                z = shifted.exp_().sum(-1)
            lse[part] = peak + z.log()
            logp[part] = picked - lse[part]
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.scale, ctx.chunk_rows, ctx.scratch, ctx.grad_into_logits = scale, chunk_rows, scratch, grad_into_logits
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        # chunk i is read into the scratch before its gradient is written: in place is safe
        grad = logits.detach() if ctx.grad_into_logits else torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            part = slice(start, start + ctx.chunk_rows)
            log_p = ctx.scratch[:logits[part].shape[0]].copy_(logits[part])
            if ctx.scale != 1.0:
                log_p.mul_(ctx.scale)
            log_p.sub_(lse[part, None])
            g = grad_logp[part] if grad_logp is not None else torch.zeros_like(lse[part])
            # d logp_t / d x_v = [v = t] - p_v;  d H / d x_v = -p_v (log p_v + H)
            if grad_entropy is not None:
                p = log_p.exp()
                chunk = p.mul_(log_p.add_(entropy[part, None]).mul_(-grad_entropy[part, None]).sub_(g[:, None]))
            else:
                chunk = log_p.exp_().mul_(-g[:, None])
            chunk.scatter_add_(-1, tokens[part, None], g[:, None])
            if ctx.scale != 1.0:
                chunk.mul_(ctx.scale)
            grad[part] = chunk
        ctx.scratch = None
        return grad, None, None, None, None, None
