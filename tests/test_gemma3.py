"""Gemma 3 (gemma3_text) in the engine and the trainer, on a tiny random Gemma3TextConfig whose
sliding window (6) is shorter than most prompts, with both layer types and a rope of each:
- the engine's greedy tokens are transformers' generate's, its log-probs transformers' forward's
  (fp32 to 1e-4; bf16 to bf16's rounding), tensor-parallel over 2 ranks as on 1;
- the trainer's packed attention honours the sliding window: its log-probs and gradients are
  transformers' eager forward's on sequences longer than the window;
- the FSDP2 Actor on 2 ranks: log-probs equal transformers', training equal on 1 and 2 ranks
  (tests/programs' fsdp_log_probs.py and fsdp_train.py, as test_fsdp.py runs them)."""
import copy
import glob
import os

import pytest
import torch
from dist import PROGRAMS, torchrun
from safetensors.torch import load_file
from test_engine import prompts_of, reference_logprobs
from test_engine_tp import SCRIPT as TP_SCRIPT
from test_fsdp import TESTS_ENV
from test_packing import padded_log_probs, packed_log_probs

from hflow import layout
from hflow.engine import LLM, SamplingParams
from hflow.workers import packing

VOCAB, EOS, WINDOW = 101, 1, 6
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def tiny_config(**overrides):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24,
        "sliding_window": WINDOW, "layer_types": LAYER_TYPES, "max_position_embeddings": 256,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
        "final_logit_softcapping": 30.0, "pad_token_id": 0, "eos_token_id": EOS, "bos_token_id": 2,
        "initializer_range": 0.2, **overrides})   # peaked logits: greedy has no near-ties


def tiny_model(seed=0, **overrides):
    """A random Gemma 3 whose norm weights are not their init (zeros: 1 + w would hide w's role)."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine_of(model, **opts) -> LLM:
    llm = LLM(model.config, **opts)
    llm.load_weights(model.state_dict().items())
    return llm


def test_greedy_tokens_and_log_probs_equal_transformers(model):
    prompts = prompts_of(range(1, 40, 3), seed=1)   # 1-37 tokens, the window is 6
    outs = engine_of(model).generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        assert got.token_ids == ref, (prompt, got.token_ids, ref)
        lp = reference_logprobs(model, prompt, got.token_ids, temperature=0)
        assert (lp - torch.tensor(got.logprobs)).abs().max() < 1e-4


def test_sampled_log_probs_equal_transformers_forward(model):
    prompts = prompts_of([3, 9, 20, 33], seed=2)
    outs = engine_of(model).generate(prompts, SamplingParams(n=3, temperature=0.8, top_k=20, max_tokens=16, seed=5))
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            lp = reference_logprobs(model, prompt, c.token_ids, temperature=0.8)
            assert (lp - torch.tensor(c.logprobs)).abs().max() < 1e-4


def test_bf16_log_probs_equal_transformers_bf16_forward(model):
    """bf16 against transformers' own bf16 forward, within the bounds test_engine_packed_bf16.py
    uses: greedy can flip at a near-tie, so tokens equal for all but one prompt."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    prompts = prompts_of(range(1, 40, 3), seed=3)
    outs = engine_of(bf16, dtype=torch.bfloat16).generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    same = 0
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        ref = bf16.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        same += got.token_ids == ref
        ids = torch.tensor([prompt + got.token_ids])
        with torch.no_grad():
            logits = bf16(ids).logits[0, len(prompt) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
        assert (lp - torch.tensor(got.logprobs)).abs().max() < 0.1
    assert same >= len(prompts) - 1, same


def test_the_window_moves_log_probs_far_beyond_the_tolerance(model):
    """The oracle is not blind to windows: the same weights with a window no prompt reaches give
    log-probs 100x the tolerance away (so the tests above check the window)."""
    wide = tiny_model(sliding_window=64)
    prompts = prompts_of(range(20, 40, 4), seed=1)
    outs = engine_of(model).generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    gap = max((reference_logprobs(wide, p, o.outputs[0].token_ids) - torch.tensor(o.outputs[0].logprobs)).abs().max()
              for p, o in zip(prompts, outs))
    assert gap > 1e-2, gap


def test_refuses_attention_softcapping_and_bidirectional_attention():
    from hflow.engine.models import build_model

    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        build_model(tiny_config(attn_logit_softcapping=50.0), 64)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        build_model(tiny_config(use_bidirectional_attention=True), 64)


@pytest.mark.dist
def test_tp2_equals_tp1(tmp_path):
    path = tmp_path / "gemma3"
    tiny_model().save_pretrained(str(path))
    run = torchrun(TP_SCRIPT, nproc=2, args=[path], tmp_path=tmp_path, timeout=300).check()
    assert "rank 0 ok" in run.output and "rank 1 ok" in run.output, run.output


# ---- the trainer's packed attention


def long_micro_batch(seed=3):
    """Rows of 2-70 tokens, most longer than the window, in no length order."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(30, 40), (1, 1), (5, 20), (12, 3), (50, 20), (7, 9), (2, 30)]
    prompts = [torch.randint(3, VOCAB, (p,), generator=g).tolist() for p, _ in shapes]
    responses = [torch.randint(3, VOCAB, (r,), generator=g).tolist() for _, r in shapes]
    return layout.sequence_tensors(prompts, responses, pad_id=0)


@pytest.mark.parametrize("overhead", [0, 10**9], ids=["a-bucket-a-row", "one-bucket"])
def test_packed_log_probs_and_gradients_equal_transformers_eager(overhead):
    reference = tiny_model(seed=1)
    reference.config._attn_implementation = "eager"
    ours = copy.deepcopy(reference)
    ours.config._attn_implementation = packing.register_attention()
    t = long_micro_batch()
    expect = padded_log_probs(reference, t)
    (expect * torch.linspace(-1, 1, expect.numel()).view_as(expect)).sum().backward()
    got, _ = packed_log_probs(ours, t, overhead)
    (got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum().backward()
    assert (got - expect).abs().max() < 1e-5
    for (name, p), q in zip(reference.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_bf16_log_probs_equal_transformers_bf16_sdpa():
    """bf16 (on CPU: explicit matmuls with the window in the mask) against transformers' own bf16
    sdpa forward, to bf16's rounding; and the window matters at that tolerance."""
    reference = tiny_model(seed=1).to(torch.bfloat16)
    reference.config._attn_implementation = "sdpa"
    ours = copy.deepcopy(reference)
    ours.config._attn_implementation = packing.register_attention()
    t = long_micro_batch()
    mask = t["response_mask"].bool()
    with torch.no_grad():
        expect = padded_log_probs(reference, t)[mask].float()
        got = packed_log_probs(ours, t, 0)[0][mask].float()
        packing_blind = copy.deepcopy(ours)
        packing_blind.config.sliding_window = 10**6   # what the packed pass computed before windows
        for layer in packing_blind.model.layers:
            layer.self_attn.sliding_window = None if layer.self_attn.sliding_window is None else 10**6
        blind = packed_log_probs(packing_blind, t, 0)[0][mask].float()
    assert (got - expect).abs().max() < 0.1
    assert (blind - expect).abs().max() > 0.2


# ---- the FSDP2 trainer on 2 ranks (test_fsdp.py's programs, on Gemma 3)


def tiny_model_dir(path, seed=0):
    """Saved sharded, as a user's would be; the window (4) is shorter than fsdp's random rollouts (up to 16)."""
    tiny_model(seed, sliding_window=4).save_pretrained(str(path), max_shard_size="40KB")
    return str(path)


@pytest.mark.dist
def test_fsdp_log_probs_equal_transformers_forward(tmp_path):
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(os.path.join(PROGRAMS, "fsdp_log_probs.py"), nproc=2, args=[path], tmp_path=tmp_path,
                   timeout=300, env=TESTS_ENV).check()
    assert run.output.count("diff") == 2


@pytest.mark.dist
def test_one_rank_and_two_ranks_train_the_same(tmp_path):
    path = tiny_model_dir(tmp_path / "model")
    for name, world in (("one", 1), ("two", 2)):
        torchrun(os.path.join(PROGRAMS, "fsdp_train.py"), nproc=world, args=[path, tmp_path / f"{name}.pt", world],
                 tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    start = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        start |= load_file(f)
    for agg in ("token-mean", "seq-mean-token-mean"):
        one, two = (torch.load(tmp_path / f"{name}.pt")[agg] for name in ("one", "two"))
        for m1, m2 in zip(one["metrics"], two["metrics"]):
            for key in m1.keys() - {"memory/actor_peak_gib"}:
                assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), (key, m1, m2)
        moved = max((w - start[n]).abs().max().item() for n, w in one["weights"].items())
        assert moved > 1e-3, "training did not change the weights"
        for name, w1 in one["weights"].items():   # tolerances as test_fsdp.py's, for the same reasons
            torch.testing.assert_close(w1, two["weights"][name], rtol=1e-5, atol=1e-4)


@pytest.mark.dist
def test_an_update_reaches_the_engine_and_a_checkpoint_resumes(tmp_path):
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(os.path.join(PROGRAMS, "gemma3_update_rollout_resume.py"), nproc=2,
                   args=[path, tmp_path / "checkpoint"], tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    assert run.output.count("engine vs training weights 0.00e+00") == 2, run.output
    assert run.output.count("resumed ok") == 2, run.output
