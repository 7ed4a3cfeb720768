"""layout.token_log_probs in chunks: the same numbers and gradients as the whole computation,
with the fp32 vocabulary-sized buffers bounded by a chunk (forward and backward)."""
import torch
import torch.nn.functional as F

from hflow.measure import AllocatedBytes
from hflow.workers.log_probs import token_log_probs


def whole(logits, tokens, temperature):
    logp_all = F.log_softmax(logits.float() / temperature, dim=-1)
    return logp_all.gather(-1, tokens[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def test_chunks_give_the_whole_computations_values_and_gradients():
    torch.manual_seed(0)
    logits = torch.randn(300, 50, dtype=torch.float64).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 50, (300,))
    logp, entropy = token_log_probs(logits, tokens, 0.7, with_entropy=True, chunk_rows=64)
    ref_logp, ref_entropy = whole(logits, tokens, 0.7)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=0)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=0)
    weights = torch.randn(300)
    (grad,) = torch.autograd.grad((logp * weights).sum() + entropy.sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_logp * weights).sum() + ref_entropy.sum(), logits)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)


def peak_bytes(chunk_rows, rows=2048, vocab=4096):
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows,))
    with AllocatedBytes() as allocated:
        logp, entropy = token_log_probs(logits, tokens, 1.0, with_entropy=True, chunk_rows=chunk_rows)
        (logp.sum() + entropy.sum()).backward()
    return allocated.peak


def test_peak_memory_is_bounded_by_a_chunk_not_the_batch():
    rows, vocab = 2048, 4096
    fp32_whole = rows * vocab * 4
    unchunked, chunked = peak_bytes(rows), peak_bytes(256)
    print(f"peak: whole {unchunked / 2**20:.0f} MiB, chunks of 256 rows {chunked / 2**20:.0f} MiB")
    assert unchunked > 2 * fp32_whole               # the fp32 copy, log-softmax, p*log p...
    # ...against the bf16 gradient of the logits (2 bytes per entry, unavoidable) plus a few
    # fp32 buffers of one chunk
    assert chunked < rows * vocab * 2 + 8 * 256 * vocab * 4
