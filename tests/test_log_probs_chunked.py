"""token_log_probs in chunks, with its own backward: the values and gradients of the whole
computation in float64 (an independent oracle: autograd through log_softmax), and the fp32
vocabulary-sized buffers bounded by a chunk (forward and backward)."""
import pytest
import torch
import torch.nn.functional as F

from hflow.distributed.byte_counters import AllocatedBytes
from hflow.workers.log_probs import token_log_probs


def whole(logits, tokens, temperature):
    logp_all = F.log_softmax(logits.double() / temperature, dim=-1)
    return logp_all.gather(-1, tokens[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunks_give_the_whole_computations_values_and_gradients(dtype, temperature, with_entropy):
    torch.manual_seed(0)
    logits = torch.randn(300, 50, dtype=torch.float64).to(dtype).requires_grad_()
    before = logits.detach().clone()
    tokens = torch.randint(0, 50, (300,))
    logp, entropy = token_log_probs(logits, tokens, temperature, with_entropy=with_entropy, chunk_rows=64)
    ref_logp, ref_entropy = whole(logits, tokens, temperature)
    assert logp.dtype == torch.float32 and (entropy is not None) == with_entropy
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=2e-6)
    weights = torch.randn(300, dtype=torch.float64)
    loss, ref_loss = (logp.double() * weights).sum(), (ref_logp * weights).sum()
    if with_entropy:
        torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=5e-6)
        loss, ref_loss = loss + entropy.sum(), ref_loss + ref_entropy.sum()
    (grad,) = torch.autograd.grad(loss, logits)
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    assert grad.dtype == dtype
    # fp32: rounding; bf16: the gradient is rounded to the logits' dtype, as autograd's would be
    atol, rtol = (5e-6, 0) if dtype == torch.float32 else (1e-5, 2 ** -8)
    torch.testing.assert_close(grad.double(), ref_grad.to(dtype).double(), rtol=rtol, atol=atol)
    assert torch.equal(logits.detach(), before)   # worked on copies: the logits are left as they were


def test_no_gradient_needed_no_graph_kept():
    logits, tokens = torch.randn(10, 20), torch.randint(0, 20, (10,))
    with torch.no_grad():
        logp, entropy = token_log_probs(logits.requires_grad_(), tokens, 1.0, with_entropy=True)
    assert not logp.requires_grad and logp.shape == entropy.shape == (10,)


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


def test_the_gradient_written_over_the_logits_is_the_same_and_holds_no_second_buffer():
    """grad_into_logits: the same gradient as into a new buffer, one [rows, vocab] buffer less
    at the backward's peak; refused on a leaf, and autograd's in-place error (not a wrong
    gradient) where another op saved the logits for its own backward."""
    torch.manual_seed(0)
    rows, vocab = 512, 2048
    hidden = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows,))
    grads, peaks = {}, {}
    for into in (False, True):
        with AllocatedBytes() as allocated:
            logp, entropy = token_log_probs(hidden * 1.0, tokens, 0.7, with_entropy=True, grad_into_logits=into)
            (grads[into],) = torch.autograd.grad((logp * torch.arange(rows)).sum() + entropy.sum(), hidden)
        peaks[into] = allocated.peak
    assert torch.equal(grads[True], grads[False])
    assert peaks[False] - peaks[True] >= rows * vocab * 2   # the bf16 gradient buffer
    with pytest.raises(ValueError, match="leaf"):
        token_log_probs(hidden, tokens, grad_into_logits=True)
    logp, _ = token_log_probs(torch.tanh(hidden), tokens, grad_into_logits=True)   # tanh saves its output
    with pytest.raises(RuntimeError, match="inplace"):
        logp.sum().backward()

