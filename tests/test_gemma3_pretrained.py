"""The engine on real Gemma 3 weights: Gemma-3-270M (base; the `gemma3_270m_dir` fixture of
conftest.py, dequantized from a Q4_K_M .gguf) against transformers. A base model gets plain-text
GSM8K prompts: 48 zero-shot, and 16 four-shot ones longer than its 512-token sliding window, so
that the window is exercised. fp32 token for token; sampled log-probs to 1e-3; bf16 as close to
fp32 as transformers' own bf16 (tests/test_pretrained.py's bounds)."""
import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hflow.engine import LLM, SamplingParams
from hflow.pretrained import resolve_model
from hflow.pretrained.packaged import stored_gguf

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "gsm8k"
NEW_TOKENS = 24
EOS = 1
WINDOW = 512
ENGINE = dict(max_model_len=1024, kv_cache_bytes=1 << 30)
# tests/test_pretrained.py's: each bf16 token one the fp32 model ranks (nearly) first, its
# log-prob the fp32 one's within bf16's rounding
BF16_LOGPROB_TOL = 0.15
BF16_LOGIT_GAP = 0.3


def gsm8k(split: str, n: int) -> list[dict]:
    path = DATA / f"{split}.jsonl"
    if not path.exists():
        pytest.skip(f"no GSM8K at {path} (the shared data beside the clone)")
    with open(path) as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


@pytest.fixture(scope="module")
def tokenizer(gemma3_270m_dir):
    return AutoTokenizer.from_pretrained(gemma3_270m_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """64 prompts as token ids (with <bos>): 48 "Question: ...\\nAnswer:", then 16 with four
    solved train questions before it, each longer than the sliding window."""
    shots = "".join(f"Question: {e['question']}\nAnswer: {e['answer']}\n\n" for e in gsm8k("train", 4))
    texts = [f"Question: {e['question']}\nAnswer:" for e in gsm8k("test", 48)]
    texts += [f"{shots}Question: {e['question']}\nAnswer:" for e in gsm8k("test", 64)[48:]]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert all(p[0] == tokenizer.bos_token_id for p in ids)
    assert min(map(len, ids[48:])) > WINDOW + 16, min(map(len, ids[48:]))
    return ids


@pytest.fixture(scope="module")
def hf_model(gemma3_270m_dir):
    return AutoModelForCausalLM.from_pretrained(gemma3_270m_dir, dtype=torch.float32).eval()


def until_eos(row: list[int]) -> list[int]:
    return row[:row.index(EOS) + 1] if EOS in row else row


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], batch: int = 16) -> list[list[int]]:
    """transformers' greedy tokens, to and with the first EOS: batched by length (left padding,
    which can move transformers' last bits: where the engine differs, hf_greedy_alone decides)."""
    out = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in idx])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx])
        rows = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        for i, row in zip(idx, rows[:, width:].tolist()):
            out[i] = until_eos(row)
    return out


@torch.no_grad()
def hf_greedy_alone(model, prompt: list[int]) -> list[int]:
    row = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return until_eos(row[0, len(prompt):].tolist())


@torch.no_grad()
def hf_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """transformers' fp32 logits at each completion token (only there: a 262k vocabulary)."""
    ids = torch.tensor([prompt + completion])
    return model(ids, logits_to_keep=len(completion) + 1).logits[0, :-1].float()


def test_fetched_gemma3_is_a_tied_gemma3_text_with_both_layer_types(gemma3_270m_dir, tokenizer):
    assert resolve_model("gemma3-270m") == gemma3_270m_dir
    model = AutoModelForCausalLM.from_pretrained(gemma3_270m_dir)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.vocab_size == 262144
    assert set(model.config.layer_types) == {"sliding_attention", "full_attention"}
    assert model.config.sliding_window == WINDOW and model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.eos_token_id == EOS and tokenizer.bos_token_id == 2
    # llama.cpp stores Gemma's norm weights as 1 + w: the dense checkpoint holds w (Gemma3RMSNorm
    # adds the 1), read here from the .gguf itself (its norms are stored unquantized)
    from gguf import GGUFReader
    stored = {t.name: t for t in GGUFReader(str(stored_gguf("gemma3-270m"))).tensors}
    for gguf_name, name in (("output_norm.weight", "model.norm.weight"),
                            ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
                            ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight")):
        raw = torch.from_numpy(stored[gguf_name].data.copy()).float()
        assert torch.equal(dict(model.named_parameters())[name].detach(), raw - 1), name


@pytest.mark.timeout(1800)   # ~4 min on an idle 2-core machine; the CPU is shared
def test_engine_greedy_equals_transformers_on_64_prompts(gemma3_270m_dir, hf_model, prompts, capsys):
    start = time.perf_counter()
    llm = LLM.from_pretrained("gemma3-270m", **ENGINE)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    engine_s = time.perf_counter() - start
    mine = [o.outputs[0].token_ids for o in outs]
    start = time.perf_counter()
    reference = hf_greedy(hf_model, prompts)
    hf_s = time.perf_counter() - start
    redone = [i for i in range(len(prompts)) if mine[i] != reference[i]]
    for i in redone:
        reference[i] = hf_greedy_alone(hf_model, prompts[i])
    equal = sum(a == b for a, b in zip(mine, reference))
    worst = max((torch.log_softmax(hf_logits(hf_model, p, t), -1).gather(1, torch.tensor(t)[:, None])[:, 0]
                 - torch.tensor(o.outputs[0].logprobs)).abs().max().item()
                for p, t, o in zip(prompts[::4], mine[::4], outs[::4]))
    with capsys.disabled():
        print(f"\ngemma3-270m fp32 greedy: tokens equal {equal}/{len(prompts)} ({len(redone)} compared unpadded), "
              f"max |d log p| {worst:.2e} (16 prompts), engine {engine_s:.1f} s, transformers (batched) {hf_s:.1f} s")
    assert sum(len(t) == NEW_TOKENS for t in mine) >= 48
    assert mine == reference
    assert worst < 1e-3


def test_engine_sampled_log_probs_are_transformers_forward(hf_model, prompts, capsys):
    some = prompts[:8] + prompts[-8:]
    outs = LLM.from_pretrained("gemma3-270m", **ENGINE).generate(
        some, SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, seed=0))
    worst = 0.0
    for prompt, out in zip(some, outs):
        tokens = out.outputs[0].token_ids
        ref = torch.log_softmax(hf_logits(hf_model, prompt, tokens), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(out.outputs[0].logprobs)).abs().max().item())
    with capsys.disabled():
        print(f"\ngemma3-270m sampled log-probs: max |d log p| {worst:.2e} over 16 x {NEW_TOKENS} tokens")
    assert worst < 1e-3


def test_engine_bf16_is_as_close_to_fp32_as_transformers_bf16(gemma3_270m_dir, hf_model, prompts, capsys):
    some = prompts[:8] + prompts[-8:]
    llm = LLM.from_pretrained(gemma3_270m_dir, dtype=torch.bfloat16, **ENGINE)
    outs = llm.generate(some, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    hf16 = AutoModelForCausalLM.from_pretrained(gemma3_270m_dir, dtype=torch.bfloat16).eval()
    mine_err, theirs_err, gaps = [], [], []
    for prompt, out in zip(some, outs):
        tokens = out.outputs[0].token_ids
        chosen = torch.tensor(tokens)[:, None]
        logits32 = hf_logits(hf_model, prompt, tokens)
        exact = torch.log_softmax(logits32, -1).gather(1, chosen)[:, 0]
        mine_err.append((torch.tensor(out.outputs[0].logprobs) - exact).abs())
        theirs = torch.log_softmax(hf_logits(hf16, prompt, tokens), -1).gather(1, chosen)[:, 0]
        theirs_err.append((theirs - exact).abs())
        gaps.append(logits32.max(-1).values - logits32.gather(1, chosen)[:, 0])
    mine, theirs, gaps = torch.cat(mine_err), torch.cat(theirs_err), torch.cat(gaps)
    with capsys.disabled():
        print(f"\ngemma3-270m bf16: log-prob diff {mine.max():.3f} (transformers bf16: {theirs.max():.3f}), mean "
              f"{mine.mean():.4f} ({theirs.mean():.4f}), logit gap {gaps.max():.3f}")
    assert mine.max() <= max(BF16_LOGPROB_TOL, 1.25 * theirs.max()) and gaps.max() <= BF16_LOGIT_GAP
    assert mine.mean() <= 1.5 * theirs.mean()


def test_the_trainers_packed_pass_equals_transformers_past_the_window(hf_model, prompts):
    """The trainer's packed attention (hflow.workers.packing) on the real weights, rows longer than
    the 512-token window and a short one packed together: log-probs equal transformers' forward."""
    import copy

    from hflow import layout
    from hflow.workers import packing

    rows = [prompts[-1][:-40], prompts[0], prompts[-2][:-60]]
    responses = [prompts[-1][-40:], [108, 236770, 236743], prompts[-2][-60:]]
    assert len(rows[0]) + len(responses[0]) > WINDOW + 32
    t = layout.sequence_tensors(rows, responses, pad_id=0)
    model = copy.deepcopy(hf_model)
    model.config._attn_implementation = packing.register_attention()
    with torch.no_grad():
        packed = packing.pack(t)
        logits = model(**packed.model_inputs(), logits_to_keep=packed.predict_at).logits[0].float()
        got = packed.unpack(torch.log_softmax(logits, -1).gather(-1, packed.targets[:, None])[:, 0])
    for i, (prompt, response) in enumerate(zip(rows, responses)):
        expect = torch.log_softmax(hf_logits(hf_model, prompt, response), -1).gather(
            1, torch.tensor(response)[:, None])[:, 0]
        assert (got[i, :len(response)] - expect).abs().max() < 1e-4, i
