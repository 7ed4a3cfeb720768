"""No model refused: a family the engine has no class for generates on transformers' own model
with the engine's paged attention (hflow/engine/models/transformers_fallback.py), behind the
same LLM interface, and trains through a recipe."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Olmo2Config, Phi3Config

from dist import PROGRAMS, torchrun
from hflow.engine import LLM, SamplingParams
from hflow.engine.models import runs_fast
from hflow.engine.models.transformers_fallback import TransformersCausalLM, why_not_runnable

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=2, bos_token_id=None)


def phi3(**overrides):   # fused qkv_proj and gate_up_proj under their own names; LongRoPE-capable rope
    return Phi3Config(**{**SHAPE, "sliding_window": None, **overrides})


def olmo2():             # norms after attention and MLP, q/k norms over all heads
    return Olmo2Config(**SHAPE)


def reference(cfg, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for name, p in model.named_parameters():   # larger weights than the init's: sharper, less tied logits
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.1)
    return model


def prompts_for(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 11, 17, 23, 8)]
    prompts[4] = prompts[3][:16] + [5, 6, 7]     # shares two full blocks with prompt 3: a prefix-cache hit
    return prompts


@pytest.mark.parametrize("make", [phi3, olmo2, lambda: phi3(sliding_window=6)], ids=["phi3", "olmo2", "phi3-window6"])
def test_a_family_without_an_engine_class_generates_what_transformers_generates(make, capfd, monkeypatch):
    from hflow.engine.models import transformers_fallback
    monkeypatch.setattr(transformers_fallback, "_NOTIFIED", set())   # the line comes once a process
    cfg = make()
    assert not runs_fast(cfg.model_type) and why_not_runnable(cfg.model_type) is None
    ref = reference(cfg)
    llm = LLM(cfg, num_kv_blocks=64, block_size=8)
    assert isinstance(llm.model, TransformersCausalLM)
    line = capfd.readouterr().err.strip().splitlines()
    assert any(f"model_type {cfg.model_type!r} generates on transformers' own model" in x and "llama" in x
               for x in line), line
    llm.load_weights(ref.state_dict().items())
    prompts = prompts_for(cfg.vocab_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert outs[4].num_cached_tokens == 16
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                generation_config=GenerationConfig(pad_token_id=0))[0, len(prompt):].tolist()
        assert completion.token_ids == expected
        logits = ref(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.logprobs), logp, atol=1e-5, rtol=0)

    # sampled, 3 samples a prompt, each sample's log-probs are transformers' on its own tokens
    outs = llm.generate(prompts[:2], SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=3))
    for prompt, out in zip(prompts, outs):
        for completion in out.outputs:
            ids = completion.token_ids
            logits = ref(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(ids)]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(completion.logprobs), logp, atol=1e-5, rtol=0)


def test_a_tied_head_saved_without_its_own_tensor_is_the_embedding(tmp_path):
    """save_pretrained writes a tied model's embedding once (no lm_head.weight): from_pretrained's
    fallback must generate with the head tied to it, as transformers does (it once sampled from
    an untouched, all-zero head: token 0 every step)."""
    cfg = phi3(tie_word_embeddings=True)
    ref = reference(cfg)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    ref.save_pretrained(tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    llm = LLM.from_pretrained(str(tmp_path))
    assert isinstance(llm.model, TransformersCausalLM)
    prompts = prompts_for(cfg.vocab_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                generation_config=GenerationConfig(pad_token_id=0))[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected


def test_a_checkpoint_missing_a_weight_is_refused_by_name(tmp_path):
    """A parameter no checkpoint tensor fills would generate from uninitialised memory."""
    from safetensors.torch import load_file, save_file
    cfg = phi3()
    reference(cfg).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no weights for 1 of the engine's parameters \(hf.model.layers.1.mlp.down_proj.weight\)"):
        LLM.from_pretrained(str(tmp_path))


def test_the_fallback_sleeps_wakes_and_takes_new_weights_in_place():
    cfg = olmo2()
    first, second = reference(cfg, 0), reference(cfg, 1)
    llm = LLM(cfg, num_kv_blocks=32, block_size=8)
    llm.load_weights(first.state_dict().items())
    prompt = prompts_for(cfg.vocab_size)[1]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    llm.sleep(2)
    llm.wake_up()
    llm.load_weights(second.state_dict().items())
    after = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    expected = second.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               generation_config=GenerationConfig(pad_token_id=0))[0, len(prompt):].tolist()
    assert after == expected and before != after


def test_what_the_fallback_cannot_run_is_refused_with_the_reason(tmp_path):
    from hflow.validation import ConfigError
    from hflow.recipe_kit.set_up import check_policy_dir
    from hflow.engine.models.layers import TPInfo

    assert "does not route its attention through transformers' attention interface" in why_not_runnable("mamba")
    assert "has no causal LM for model_type 'bert-ish'" in why_not_runnable("bert-ish")
    with pytest.raises(NotImplementedError, match="soft-caps attention scores"):
        TransformersCausalLM(phi3(attn_logit_softcapping=50.0), 64)

    two_ranks = TPInfo()
    two_ranks.size = 2
    with pytest.raises(ValueError, match="no tensor parallelism: use --rollout.tp-size 1"):
        TransformersCausalLM(phi3(), 64, two_ranks)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    check_policy_dir(tmp_path)   # runs: on the fallback
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ConfigError, match="model_type 'mamba' is not supported: transformers' MambaForCausalLM"):
        check_policy_dir(tmp_path)


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    """A random Phi-3 with the embedded default's tokenizer: a family the engine has no class for."""
    from hflow.default.model import build_tokenizer
    tokenizer = build_tokenizer()
    path = tmp_path_factory.mktemp("phi3") / "model"
    model = reference(phi3(vocab_size=-(-len(tokenizer) // 64) * 64, max_position_embeddings=128))
    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0, do_sample=False)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.dist
def test_grpo_trains_a_family_the_engine_lacks_and_its_engine_follows_the_trainer(tiny_phi3, tmp_path):
    """Two GRPO steps on 2 ranks: the engine's log-probs equal the trainer's recomputed ones in
    fp32 at both steps, the second after the first update's weights were synced into the
    fallback model, and the update moved the weights."""
    run = torchrun(str(RECIPES / "grpo.py"), 2, [
        "--model.path", tiny_phi3, "--trainer.output-dir", tmp_path, "--trainer.steps", 2,
        "--data.batch-size", 4, "--rollout.n", 2, "--rollout.max-tokens", 6, "--trainer.eval-size", 8,
        "--trainer.logging.no-progress-bars", "--algo.rollout-correction", "mis", "--actor.epochs", 2,
        "--actor.optim.lr", 1e-3, "--reward.fn", "dapo_rewards:length_parity"],
        timeout=400, env={"PYTHONPATH": PROGRAMS})
    run.check()
    assert "model_type 'phi3' generates on transformers' own model" in run.output
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/mismatch/abs_log_ratio_max" in r]
    assert len(steps) == 2
    assert all(r["actor/mismatch/abs_log_ratio_max"] < 1e-5 for r in steps), steps
    assert all(r["actor/grad_norm"] > 0 for r in steps)
