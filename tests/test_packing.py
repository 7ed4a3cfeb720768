"""Packed training passes (hflow/workers/packing.py) against transformers' own padded forward:
the same log-probs and the same gradients, whatever the attention buckets."""
import copy

import pytest
import torch

from hflow import layout
from hflow.workers import micro_batches, packing


def tiny_qwen2(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2, attn_implementation="eager")
    return Qwen2ForCausalLM(config).float()


def micro_batch(seed=3):
    """Rows whose lengths vary (2-70 tokens) and are not in length order, two of them equal."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(30, 40), (1, 1), (5, 20), (12, 3), (1, 1), (50, 20), (7, 9), (2, 30)]
    prompts = [torch.randint(3, 97, (p,), generator=g).tolist() for p, _ in shapes]
    responses = [torch.randint(3, 97, (r,), generator=g).tolist() for _, r in shapes]
    return layout.sequence_tensors(prompts, responses, pad_id=0)


def padded_log_probs(model, t):
    """The oracle: transformers' eager attention over the padded [b, P + R] batch."""
    logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                   position_ids=layout.position_ids(t["attention_mask"])).logits
    R = t["response_mask"].shape[1]
    logp = torch.log_softmax(logits[:, -R - 1:-1], -1).gather(-1, t["responses"][..., None])[..., 0]
    return logp * t["response_mask"]


def packed_log_probs(model, t, overhead):
    packed = packing.pack(t, overhead=overhead)
    logits = model(**packed.model_inputs(), logits_to_keep=packed.predict_at).logits[0]
    return packed.unpack(torch.log_softmax(logits, -1).gather(-1, packed.targets[:, None])[:, 0]), packed


def assert_packed_matches_padded(t, overhead):
    """Packed log-probs and every parameter's gradient (of a weighted sum of the log-probs) equal
    the padded oracle's; returns the Packed."""
    reference = tiny_qwen2()
    model = copy.deepcopy(reference)
    model.config._attn_implementation = packing.register_attention()
    expect = padded_log_probs(reference, t)
    (expect * torch.linspace(-1, 1, expect.numel()).view_as(expect)).sum().backward()
    got, packed = packed_log_probs(model, t, overhead)
    (got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum().backward()
    assert torch.allclose(got, expect, atol=1e-5)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    return packed


@pytest.mark.parametrize("overhead", [0.0, packing.BUCKET_OVERHEAD, 1e12])   # a bucket per length ... one bucket
def test_packed_log_probs_and_gradients_equal_the_padded_forward(overhead):
    packed = assert_packed_matches_padded(micro_batch(), overhead)
    if overhead == 0:
        assert len(packed.buckets) == 3   # lengths 2, 2, 15, 16 | 25, 32 | 70, 70: one per 16-token granule
    if overhead == 1e12:
        assert len(packed.buckets) == 1


def test_pack_keeps_each_rows_tokens_in_place():
    t = micro_batch()
    packed = packing.pack(t)
    mask = t["attention_mask"].bool()
    lengths = mask.sum(1)
    ids = packed.input_ids[0]
    assert packed.buckets.scatter.numel() == int(lengths.sum()) == ids.numel()   # no prompt is shared here
    for i in range(len(lengths)):   # the row's last token, and its tokens ending there
        last = int(packed.last[i])
        assert ids[last - lengths[i] + 1:last + 1].tolist() == t["input_ids"][i][mask[i]].tolist()
    assert torch.equal(packed.unpack(packed.targets.float()), t["responses"].float() * t["response_mask"])
    order = [int(s) for s in packed.last]   # shortest row first (ties in row order)
    assert sorted(order) == [order[i] for i in torch.argsort(lengths, stable=True).tolist()]


def grouped_micro_batch(seed=5):
    """Three prompts with 4, 1 and 3 samples, rows interleaved, responses of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 97, (p,), generator=g).tolist() for p in (20, 6, 33)]
    which = [0, 2, 0, 1, 2, 0, 2, 0]
    responses = [torch.randint(3, 97, (r,), generator=g).tolist() for r in (5, 40, 1, 12, 3, 25, 17, 9)]
    return layout.sequence_tensors([prompts[w] for w in which], responses, pad_id=0), prompts, responses


@pytest.mark.parametrize("overhead", [0.0, packing.BUCKET_OVERHEAD, 1e12])
def test_shared_prompts_are_packed_once_with_the_same_log_probs_and_gradients(overhead):
    t, prompts, responses = grouped_micro_batch()
    groups, which = micro_batches.prompt_groups(t).tolist(), [0, 2, 0, 1, 2, 0, 2, 0]
    assert all((groups[i] == groups[j]) == (which[i] == which[j]) for i in range(8) for j in range(8))
    packed = assert_packed_matches_padded(t, overhead)
    # each prompt's tokens once, every response's
    assert packed.input_ids.shape[1] == sum(map(len, prompts)) + sum(map(len, responses))
    unshared = packing.pack(t, overhead=overhead, share_prompts=False)
    assert unshared.input_ids.shape[1] == int(t["attention_mask"].sum())


def test_shared_prompt_rows_read_their_last_token_and_positions():
    t, prompts, responses = grouped_micro_batch()
    packed = packing.pack(t)
    ids, pos = packed.input_ids[0], packed.position_ids[0]
    which = [0, 2, 0, 1, 2, 0, 2, 0]
    for i, (w, r) in enumerate(zip(which, responses)):
        last = int(packed.last[i])
        assert int(ids[last]) == r[-1] and int(pos[last]) == len(prompts[w]) + len(r) - 1
    # the first response token of every row is predicted from its prompt's last token
    first = packed.cols == 0
    assert [int(ids[k]) for k in packed.predict_at[first]] == [prompts[w][-1] for w in which]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_causal_attention_against_float64(dtype):
    """Each bucket's attention (explicit matmuls on CPU in bf16, torch's SDPA in fp32 and fp64), values
    and gradients, against SDPA in float64: in bf16 as close as torch's own CPU kernel gets."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 23, heads, 16, dtype=torch.float64).transpose(1, 2).requires_grad_()
               for heads in (8, 2, 2))
    grad_out = torch.randn(3, 8, 23, 16, dtype=torch.float64)

    def errors(attend):
        inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = attend(*inputs)
        grads = torch.autograd.grad(out, inputs, grad_out.to(dtype))
        return [(a.double() - b).abs().max().item() for a, b in zip((out, *grads), (expect, *expect_grads))]

    expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)
    expect_grads = torch.autograd.grad(expect, (q, k, v), grad_out)
    ours = errors(lambda *x: packing.causal_attention(*x, 0.3))
    torchs = errors(lambda *x: torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True,
                                                                                scale=0.3))
    if dtype != torch.bfloat16:
        assert ours == torchs and max(ours) < 1e-5
    else:   # bf16 rounding (2^-8 relative) of values ~1, and no more than torch's kernel's, give or take
        assert max(ours) < 0.05 and all(a <= 2.5 * b + 1e-3 for a, b in zip(ours, torchs)), (ours, torchs)


def test_packed_bf16_matches_the_padded_forward_to_bf16_rounding():
    """In bf16 (the explicit-matmul attention on CPU) the packed log-probs are transformers'
    eager padded forward's to within bf16 rounding."""
    t = micro_batch()
    reference = tiny_qwen2().bfloat16()
    model = copy.deepcopy(reference)
    model.config._attn_implementation = packing.register_attention()
    with torch.no_grad():
        expect = padded_log_probs(reference, t).float()
        got = packed_log_probs(model, t, packing.BUCKET_OVERHEAD)[0].float()
    assert expect.abs().max() > 1   # log-probs of ~97 tokens: ~ -4.6
    assert (got - expect).abs().max() < 0.08, (got - expect).abs().max()
