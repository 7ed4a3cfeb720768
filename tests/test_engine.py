"""hflow.engine against transformers' own forward and generate, on tiny random models saved to
disk and loaded back with LLM.from_pretrained, as a user's would be."""
import itertools
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from hflow.engine import LLM, EngineConfig, SamplingParams
from hflow.engine.attention import plan_buckets
from hflow.engine.sampler import sample
from hflow.engine.sequence import Sequence

VOCAB, EOS = 96, 2
# HFLOW_DEVICE=cuda runs the engine of these tests on a GPU (scripts/gpu_check.sh); the
# transformers oracles stay on CPU in fp32
DEVICE = torch.device(os.environ.get("HFLOW_DEVICE", "cpu"))
PROMPT_LENGTHS = list(range(1, 65))


def tiny_config(arch: str):
    """Four architectures with the features that differ between them: GQA, tied and untied
    embeddings, rope scaling (llama3, yarn), qkv bias, q/k norm with an explicit head_dim,
    a sliding window shorter than the prompts."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=EOS, bos_token_id=1, pad_token_id=0,
                  initializer_range=0.2)  # peaked logits: greedy has no near-ties
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "qwen3":
        return Qwen3Config(**{**common, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=True)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=16, tie_word_embeddings=False)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch)).eval()


def engine_of(model, **opts) -> LLM:
    """An engine holding an in-memory transformers model's weights, loaded as RL hands them over."""
    llm = LLM(model.config, device=DEVICE, **opts)
    llm.load_weights(model.state_dict().items())
    return llm


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> (directory, the transformers model saved there); llama is saved sharded."""
    out = {}
    for arch in ("llama", "qwen2", "qwen3", "mistral"):
        model = tiny_model(arch)
        path = str(tmp_path_factory.mktemp(arch))
        model.save_pretrained(path, max_shard_size="100KB" if arch == "llama" else "1GB")
        out[arch] = (path, model)
    assert os.path.exists(os.path.join(out["llama"][0], "model.safetensors.index.json"))
    return out


def prompts_of(lengths, seed=0):
    rnd = random.Random(seed)
    return [[rnd.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@torch.no_grad()
def reference_logprobs(model, prompt, completion, temperature=1.0):
    """log_softmax(logits / T) of a transformers forward at each completion token."""
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers_generate(saved, arch):
    path, model = saved[arch]
    llm = LLM.from_pretrained(path, device=DEVICE)
    prompts = prompts_of(PROMPT_LENGTHS, seed=len(arch))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))  # one batch of all 64
    for prompt, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        got = out.outputs[0]
        assert got.token_ids == ref, f"{arch}, prompt of {len(prompt)} tokens"
        assert got.finish_reason == ("stop" if ref[-1] == EOS else "length")
        lp = reference_logprobs(model, prompt, got.token_ids, temperature=0)
        assert (lp - torch.tensor(got.logprobs)).abs().max() < 1e-4
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > len(outs) // 2  # not degenerate


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_weights_match_transformers_generate(saved, arch, monkeypatch):
    """Small decode batches switch the matmuls to packed weights (oneDNN, CPU fp32): greedy
    output still equals transformers' generate; new weights drop the packed copies."""
    import hflow.engine.model_runner as model_runner

    path, model = saved[arch]
    llm = LLM.from_pretrained(path, device=DEVICE)
    if not llm.runner.packable:
        pytest.skip("no oneDNN packed matmul here")
    monkeypatch.setattr(model_runner, "PACK_MIN_STEPS", 1)
    prompts = prompts_of(PROMPT_LENGTHS[::3], seed=7)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert llm.runner.packed and llm.model.layers[0].mlp.down_proj.packed is not None
    for prompt, out in zip(prompts, outs):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, f"{arch}, prompt of {len(prompt)} tokens"
        lp = reference_logprobs(model, prompt, ref, temperature=0)
        assert (lp - torch.tensor(out.outputs[0].logprobs)).abs().max() < 1e-4
    llm.load_weights(model.state_dict().items())
    assert not llm.runner.packed and llm.model.layers[0].mlp.down_proj.packed is None


def test_sampled_logprobs_match_forward(saved):
    path, model = saved["qwen2"]
    llm = LLM.from_pretrained(path, device=DEVICE)
    prompts = prompts_of([5, 20, 40])
    temp = 0.7
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=temp, top_k=12, top_p=0.9, max_tokens=16, seed=3))
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs) == 3
        for c in out.outputs:
            lp = reference_logprobs(model, prompt, c.token_ids, temperature=temp)
            assert (lp - torch.tensor(c.logprobs)).abs().max() < 1e-4
            with torch.no_grad():  # every token comes from the top-12 of its step
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
            rank = (logits > logits.gather(1, torch.tensor(c.token_ids)[:, None])).sum(-1)
            assert int(rank.max()) < 12


def _fake_seqs(params_list, seed=0):
    return [Sequence(seq_id=i, request_id=i, sample_index=0, token_ids=[0], num_prompt_tokens=1, params=p,
                     stop_ids=frozenset(), max_len=10, rng=random.Random(seed + i))
            for i, p in enumerate(params_list)]


def test_sampler_draws_from_the_filtered_distribution():
    """Frequencies over 4000 draws match the analytic (top-k, then top-p renormalised)
    distribution; greedy rows take the argmax."""
    torch.manual_seed(0)
    logits = torch.randn(6) * 1.5
    draws = 4000
    cases = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=3),
             SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.9, top_k=4, top_p=0.7)]
    for params in cases:
        seqs = _fake_seqs([params] * draws)
        tokens, logps = sample(logits.expand(draws, -1).clone(), seqs)
        probs = torch.softmax(logits / params.temperature, -1)
        assert torch.allclose(logps, probs.log()[tokens], atol=1e-6)
        order = probs.argsort(descending=True)
        keep = torch.zeros(6, dtype=torch.bool)
        keep[order[:params.top_k or 6]] = True
        p = probs * keep
        p = p / p.sum()
        mass_before = p[order].cumsum(0) - p[order]
        keep[order[mass_before >= params.top_p]] = False
        expected = probs * keep / (probs * keep).sum()
        freq = torch.bincount(tokens, minlength=6).float() / draws
        assert (freq[~keep] == 0).all()
        assert (freq - expected).abs().max() < 0.035, (params, freq, expected)
    tokens, _ = sample(logits[None].clone(), _fake_seqs([SamplingParams(temperature=0)]))
    assert tokens.item() == logits.argmax().item()


def test_filtered_sampling_returns_the_unfiltered_log_prob():
    """With top-k / top-p the engine returns log_softmax(logits / T)[token] over the whole
    vocabulary (what actor.log_probs recomputes), not the filtered, renormalised log-prob.
    The expected figures are computed by hand for logits (2, 1, 0.5, -1)."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    e = [math.exp(x) for x in (2.0, 1.0, 0.5, -1.0)]
    # T = 1, top_p = 0.5: p(0) = e^2 / sum = 0.6095 >= 0.5, so only token 0 is kept
    top_p = SamplingParams(temperature=1.0, top_p=0.5)
    # T = 0.5, top_k = 2: z = (4, 2, 1, -2), tokens 0 and 1 kept
    e_half = [math.exp(x) for x in (4.0, 2.0, 1.0, -2.0)]
    top_k = SamplingParams(temperature=0.5, top_k=2)
    cases = [(top_p, {0: math.log(e[0] / sum(e))}, {0: 0.0}),
             (top_k, {0: 4 - math.log(sum(e_half)), 1: 2 - math.log(sum(e_half))},
              {0: 4 - math.log(sum(e_half[:2])), 1: 2 - math.log(sum(e_half[:2]))})]
    assert abs(cases[0][1][0] - math.log(0.6095)) < 1e-3
    for params, unfiltered, filtered in cases:
        seqs = _fake_seqs([params] * 200, seed=5)
        tokens, logps = sample(logits.expand(200, -1).clone(), seqs)
        assert set(tokens.tolist()) == set(unfiltered)
        for token, logp in zip(tokens.tolist(), logps.tolist()):
            assert abs(logp - unfiltered[token]) < 1e-5
            assert abs(logp - filtered[token]) > 0.01


def test_prefix_caching_and_preemption_give_the_same_tokens(saved):
    path, _ = saved["llama"]
    base = prompts_of([40, 9, 33])
    prompts = [base[0], base[0][:20] + base[1], base[2], base[0], base[1] + base[2]]  # shared prefixes
    greedy = SamplingParams(n=2, temperature=0, max_tokens=24)
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=11)
    results = []
    for opts in (dict(), dict(enable_prefix_caching=False), dict(num_kv_blocks=9), dict(num_kv_blocks=9, max_num_seqs=3),
                 dict(max_num_batched_tokens=40)):  # one prompt per prefill step
        llm = LLM.from_pretrained(path, device=DEVICE, **opts)
        g = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, greedy)]
        s = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sampled)]
        results.append((g, s, llm.stats()))
    for g, s, _ in results[1:]:
        assert g == results[0][0]
        assert s == results[0][1]
    assert results[0][2]["num_preemptions"] == 0
    assert results[2][2]["num_preemptions"] > 0, results[2][2]
    assert results[2][2]["peak_used_blocks"] <= 9


def test_block_counts_show_prefix_sharing(saved):
    path, _ = saved["qwen3"]
    prompt = prompts_of([70])[0]  # 4 full blocks of 16 + 6 tokens
    params = SamplingParams(n=8, temperature=1.0, max_tokens=4, ignore_eos=True, seed=0)
    shared = LLM.from_pretrained(path, device=DEVICE, block_size=16)
    shared.generate([prompt], params)
    # 4 shared prompt blocks + each sample's own last block (6 prompt tokens + 4 new)
    assert shared.stats()["peak_used_blocks"] == 4 + 8
    shared.generate([prompt, prompt], SamplingParams(n=1, temperature=0, max_tokens=4, ignore_eos=True))
    assert shared.stats()["peak_used_blocks"] == 4 + 2  # identical prompts across requests share too
    unshared = LLM.from_pretrained(path, device=DEVICE, block_size=16, enable_prefix_caching=False)
    unshared.generate([prompt], params)
    assert unshared.stats()["peak_used_blocks"] == 8 * 5


def test_max_tokens_stop_tokens_and_ignore_eos(saved, tmp_path):
    path, model = saved["qwen2"]
    llm = LLM.from_pretrained(path, device=DEVICE)
    prompts = prompts_of([12, 30])
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for prompt, out in zip(prompts, free):
        c = out.outputs[0]
        assert len(c.token_ids) == 30 and c.finish_reason == "length"
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, min_new_tokens=0,
                             eos_token_id=VOCAB + 1)  # an id never produced: no stopping
        assert c.token_ids == ref[0, len(prompt):].tolist()
        # stop on a token that appears mid-way: output ends right there, with the stop token
        stop = c.token_ids[10]
        first = c.token_ids.index(stop)
        short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))
        assert short[0].outputs[0].token_ids == c.token_ids[:first + 1]
        assert short[0].outputs[0].finish_reason == "stop"
        capped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert capped[0].outputs[0].token_ids == c.token_ids[:5]
    # the default stop set is the EOS of the saved generation config: make it a token met mid-way
    c = free[0].outputs[0]
    model.generation_config.eos_token_id = c.token_ids[7]
    model.save_pretrained(str(tmp_path))
    model.generation_config.eos_token_id = EOS
    eos_llm = LLM.from_pretrained(str(tmp_path), device=DEVICE)
    stopped = eos_llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert stopped.token_ids == c.token_ids[:c.token_ids.index(c.token_ids[7]) + 1]
    assert stopped.finish_reason == "stop"
    ignored = eos_llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert ignored[0].outputs[0].token_ids == c.token_ids


def test_same_seed_same_tokens(saved):
    path, _ = saved["mistral"]
    llm = LLM.from_pretrained(path, device=DEVICE)
    prompts = prompts_of([10, 25])
    params = SamplingParams(n=4, temperature=1.0, max_tokens=20, ignore_eos=True, seed=5)
    a = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    b = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[::-1] + prompts_of([3, 50], seed=9), params)]
    assert a == b[:2][::-1]
    assert len({tuple(t) for t in a[0]}) == 4  # the n samples differ from each other
    c = llm.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=20, ignore_eos=True, seed=6))
    assert [[x.token_ids for x in o.outputs] for o in c] != a
    # the same request twice in one batch gives the same tokens
    twice = llm.generate([prompts[0], prompts[0]], params)
    assert [x.token_ids for x in twice[0].outputs] == [x.token_ids for x in twice[1].outputs] == a[0]


def test_sleep_wake_and_load_weights_in_place(saved):
    path, model = saved["qwen3"]
    prompts = prompts_of([5, 18, 40])
    params = SamplingParams(n=2, temperature=0.9, max_tokens=16, seed=1)
    llm = LLM.from_pretrained(path, device=DEVICE)
    first = llm.generate(prompts, params)
    params_before = dict(llm.model.named_parameters())

    llm.sleep(level=1)
    assert llm.runner.kv_cache is None
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(prompts, params)
    llm.wake_up()
    assert _tokens(llm.generate(prompts, params)) == _tokens(first)

    llm.sleep(level=2)
    assert all(p.untyped_storage().nbytes() == 0 for p in llm.model.parameters())
    llm.wake_up()
    assert dict(llm.model.named_parameters()) == params_before  # the same Parameter objects
    ptrs = {n: p.data_ptr() for n, p in llm.model.named_parameters()}
    llm.load_weights(model.state_dict().items())
    assert _tokens(llm.generate(prompts, params)) == _tokens(first)

    other = tiny_model("qwen3", seed=1)  # new weights in place: same as a fresh engine of them
    loaded = llm.load_weights(other.state_dict().items())
    assert {n: p.data_ptr() for n, p in llm.model.named_parameters()} == ptrs
    assert "model.layers.1.self_attn.k_proj.weight" in loaded
    assert _tokens(llm.generate(prompts, params)) == _tokens(engine_of(other).generate(prompts, params))


def test_kv_blocks_are_zeroed_on_first_use(saved):
    """The cache is allocated uninitialised and a block is zeroed when first handed out:
    garbage (NaN) in the rest never reaches the outputs, and waking up costs no full zeroing."""
    path, _ = saved["qwen2"]
    llm = LLM.from_pretrained(path, device=DEVICE)
    prompts, params = prompts_of([5, 20, 40]), SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=2)
    expected = _tokens(llm.generate(prompts, params))
    runner, allocate = llm.runner, llm.runner.allocate_kv_cache

    def allocate_garbage():
        fresh = runner.kv_cache is None
        allocate()
        if fresh:
            runner.kv_cache[:, :, runner.num_zeroed_blocks:runner.num_blocks].fill_(float("nan"))
    runner.allocate_kv_cache = allocate_garbage
    for _ in range(2):
        llm.sleep()
        llm.wake_up()
        assert _tokens(llm.generate(prompts, params)) == expected
        assert runner.num_zeroed_blocks <= llm.stats()["peak_used_blocks"] < runner.num_blocks // 4


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_a_config_and_load_weights_give_what_from_pretrained_gives(saved):
    path, model = saved["llama"]
    prompts = prompts_of([7, 30])
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = _tokens(LLM.from_pretrained(path, device=DEVICE).generate(prompts, params))
    assert _tokens(engine_of(model).generate(prompts, params)) == expected
    assert _tokens(engine_of(model, engine_config=EngineConfig(block_size=8)).generate(prompts, params)) == expected
    with pytest.raises(TypeError, match="load_weights"):
        LLM(model)


def test_clear_errors(saved):
    from transformers import MambaConfig

    # a family of no engine class runs on transformers' model (test_engine_fallback.py), unless it cannot
    with pytest.raises(ValueError, match=r"cannot run model_type 'mamba': transformers' MambaForCausalLM does not route"):
        LLM(MambaConfig(num_hidden_layers=1, hidden_size=32, max_position_embeddings=64))
    path, model = saved["qwen2"]
    llm = LLM.from_pretrained(path, device=DEVICE)
    with pytest.raises(KeyError, match="unexpected weight"):
        llm.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"has shape \(3, 3\)"):
        llm.load_weights([("model.norm.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="KV blocks"):
        LLM.from_pretrained(path, device=DEVICE, num_kv_blocks=2).generate([[5] * 40], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=r"outside \[0, 96\)"):
        llm.generate([[5, 6], [7, VOCAB]])  # the first, valid request is dropped too
    assert llm.scheduler.is_finished()
    # an error in the middle of generate leaves the engine usable
    prompts, params = prompts_of([20, 35]), SamplingParams(temperature=0, max_tokens=8)
    expected = _tokens(llm.generate(prompts, params))
    step, calls = llm.runner.step, []

    def failing_step(seqs, is_prefill):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return step(seqs, is_prefill)
    llm.runner.step = failing_step
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(prompts, params)
    llm.runner.step = step
    assert llm.block_manager.num_used_blocks == 0
    assert _tokens(llm.generate(prompts, params)) == expected


def _run_to_the_end(llm) -> dict:
    """Step until the engine is idle: request id -> its RequestOutput, each returned once."""
    outs = {}
    while llm.has_unfinished():
        for out in llm.step():
            assert out.request_id not in outs
            assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
            outs[out.request_id] = out
    return outs


def _completions(out):
    return [(c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs]


def test_add_request_and_step_give_what_generate_gives(saved):
    path, _ = saved["qwen2"]
    prompts = prompts_of([5, 20, 40, 20])
    params = [SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=4), SamplingParams(temperature=0, max_tokens=10)] * 2
    expected = LLM.from_pretrained(path, device=DEVICE).generate(prompts, params)
    llm = LLM.from_pretrained(path, device=DEVICE)
    assert not llm.has_unfinished() and llm.step() == []
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    assert len(set(ids)) == 4 and llm.has_unfinished()
    outs = _run_to_the_end(llm)
    assert [outs[i].prompt_token_ids for i in ids] == [o.prompt_token_ids for o in expected]
    assert [_completions(outs[i]) for i in ids] == [_completions(o) for o in expected]
    assert llm.block_manager.num_used_blocks == 0
    # ids are the caller's when given; generate() and sleep() need an idle engine
    assert llm.add_request(prompts[0], request_id="mine") == "mine"
    with pytest.raises(ValueError, match="already unfinished"):
        llm.add_request(prompts[1], request_id="mine")
    with pytest.raises(ValueError, match="is empty"):
        llm.add_request([])
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.generate(prompts, params)
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep()
    assert list(_run_to_the_end(llm)) == ["mine"]


def test_a_request_added_between_steps_joins_the_batch_and_reuses_cached_blocks(saved):
    """What a multi-turn agent does: a request added while others decode runs with them, takes
    the cached KV of its prompt's prefix (a running prompt's full blocks; once a turn has ended,
    the blocks its prompt and response filled) and gives the tokens it gives alone."""
    path, _ = saved["llama"]
    first, other = prompts_of([40, 12])                   # first: 2 full blocks of 16, then 8 tokens
    joining = first[:32] + prompts_of([5], seed=1)[0]     # first's 2 full blocks, then tokens of its own
    params = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    alone = LLM.from_pretrained(path, device=DEVICE)
    expected = [_tokens(alone.generate([p], params))[0] for p in (first, other, joining)]

    llm = LLM.from_pretrained(path, device=DEVICE, block_size=16)
    a, b = llm.add_request(first, params), llm.add_request(other, params)
    for _ in range(3):                                    # a prefill, then decode steps
        assert llm.step() == []
    c = llm.add_request(joining, params)
    assert llm.step() == []                               # its prefill: prefill goes first
    samples = {r: [s for s in llm.scheduler.running if s.request_id == r] for r in (a, b, c)}
    assert [len(samples[r]) for r in (a, b, c)] == [2, 2, 2]
    assert all(s.num_cached_tokens == 32 and s.block_table[:2] == samples[a][0].block_table[:2] for s in samples[c])
    outs = _run_to_the_end(llm)
    assert [_tokens([outs[r]])[0] for r in (a, b, c)] == expected

    # the next turn: first's prompt + its response + new tokens (40 + 24 + 3)
    turn = first + outs[a].outputs[0].token_ids + prompts_of([3], seed=2)[0]
    d = llm.add_request(turn, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.step()
    (seq,) = [s for s in llm.scheduler.running if s.request_id == d]
    # tokens 0-47: the prompt's 2 blocks and the block the response filled; the KV of token 63,
    # the last sampled, was never computed, so the block of tokens 48-63 is not cached
    assert seq.num_cached_tokens == 48
    finished = _run_to_the_end(llm)
    assert list(finished) == [d] and finished[d].num_cached_tokens == 48   # what the caller sees
    assert outs[c].num_cached_tokens == 32 and outs[b].num_cached_tokens == 0


def test_abort_frees_a_requests_blocks_and_the_others_finish_unchanged(saved):
    path, _ = saved["mistral"]
    prompts = prompts_of([30, 25, 18])
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, ignore_eos=True, seed=8)
    expected = _tokens(LLM.from_pretrained(path, device=DEVICE).generate([prompts[0], prompts[2]], params))
    llm = LLM.from_pretrained(path, device=DEVICE)
    a, b, c = (llm.add_request(p, params) for p in prompts)
    for _ in range(4):
        llm.step()
    tables = {r: [s.block_table for s in llm.scheduler.running if s.request_id == r] for r in (a, b, c)}
    own = {blk for t in tables[b] for blk in t} - {blk for r in (a, c) for t in tables[r] for blk in t}
    assert len(own) == 3                                  # its shared full prompt block + each sample's last
    used = llm.block_manager.num_used_blocks
    llm.abort(b)
    assert llm.block_manager.num_used_blocks == used - len(own)
    assert all(s.request_id != b for s in llm.scheduler.running)
    waiting = llm.add_request(prompts[1], params)          # dropped before it ever ran
    llm.abort(waiting)
    assert not any(s.request_id == waiting for s in llm.scheduler.waiting)
    with pytest.raises(KeyError, match="no unfinished request"):
        llm.abort(b)
    outs = _run_to_the_end(llm)
    assert sorted(outs) == [a, c]
    assert _tokens([outs[a], outs[c]]) == expected
    assert llm.block_manager.num_used_blocks == 0 and not llm.has_unfinished()


def test_plan_buckets_is_optimal():
    """The bucket plan equals the cheapest of all contiguous partitions (brute force)."""
    rnd = random.Random(0)
    for _ in range(30):
        rows = sorted(rnd.randint(1, 9) for _ in range(rnd.randint(1, 9)))
        overhead = rnd.choice([0, 10, 50, 500])

        def cost(spans):
            return sum((e - s) * rows[e - 1] * 16 + overhead for s, e in spans)
        best = min(cost(list(zip((0,) + cuts, cuts + (len(rows),))))
                   for k in range(len(rows)) for cuts in itertools.combinations(range(1, len(rows)), k))
        spans = plan_buckets(rows, 16, overhead)
        assert spans[0][0] == 0 and spans[-1][1] == len(rows)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert cost(spans) == best


def word_tokenizer(path):
    """Save a word-level tokenizer for the tiny vocabulary (w0 .. w92, <s> = 1, </s> = 2) in
    `path`; return it as AutoTokenizer loads it back."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(VOCAB - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("w5 w17 w3")["input_ids"] == [8, 20, 6]
    return tokenizer


CLI_DEVICE = [] if DEVICE.type == "cpu" else ["--device", str(DEVICE), "--dtype", "float32"]


def test_cli_prints_a_completion(saved, tmp_path):
    path, model = saved["llama"]
    tokenizer = word_tokenizer(path)
    prompt = "w5 w17 w3 w40 w41 w9"
    ids = tokenizer(prompt)["input_ids"]
    ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    run = subprocess.run([sys.executable, "-m", "hflow.engine", "--model", path, "--prompt", prompt,
                          "--max-tokens", "8", *CLI_DEVICE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == tokenizer.decode(ref, skip_special_tokens=True).strip()
    assert run.stdout.strip()
    # several prompts or samples: a label above each completion
    run = subprocess.run([sys.executable, "-m", "hflow.engine", "--model", path, "--prompt", prompt,
                          "--prompt", "w7 w8", "--n", "2", "--temperature", "1", "--seed", "0",
                          "--max-tokens", "4", *CLI_DEVICE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    labels = [line for line in run.stdout.splitlines() if line.startswith("--- ")]
    assert labels == [f"--- prompt {i}/2 {p!r}, sample {j}/2 ---" for i, p in ((1, prompt), (2, "w7 w8"))
                      for j in (1, 2)], run.stdout


def test_string_prompts_and_text(saved):
    """generate() takes strings (the engine's tokenizer), token ids, or a mix; every output
    has .text, the decoded completion without special tokens; token_ids end with the stop token."""
    path, model = saved["llama"]
    tokenizer = word_tokenizer(path)
    llm = LLM.from_pretrained(path, device=DEVICE)
    text = "w5 w17 w3 w40 w41 w9"
    ids = tokenizer(text)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=30)
    by_ids = llm.generate([ids, [9, 10]], params)
    by_text = llm.generate([text, [9, 10]], params)
    assert _tokens(by_text) == _tokens(by_ids)
    assert by_text[0].prompt == text and by_text[0].prompt_token_ids == ids and by_text[1].prompt is None
    assert _tokens(llm.generate(text, params)) == _tokens(by_ids[:1])   # one prompt alone
    for out in by_text:
        c = out.outputs[0]
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and "</s>" not in c.text
    assert any(o.outputs[0].finish_reason == "stop" for o in by_text + by_ids), "no stop token met"
    # no tokenizer: strings are refused, text is None
    bare = engine_of(model)
    assert bare.generate([ids], params)[0].outputs[0].text is None
    with pytest.raises(ValueError, match="string prompts need a tokenizer"):
        bare.generate([text], params)
    assert LLM.from_pretrained(saved["qwen2"][0], device=DEVICE).tokenizer is None   # weights only: no empty tokenizer made up
    given = engine_of(model, tokenizer=tokenizer)
    assert _tokens(given.generate([text], params)) == _tokens(by_ids[:1])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("window", [None, 5])
def test_masked_prefill_folds_query_groups(heads, kv_heads, window):
    """Prefill over a cached prefix (or a window) folds the query heads onto their KV head, so
    the mask never meets enable_gqa (CUDA's fast kernels refuse that pair): the same values as
    SDPA with enable_gqa and the mask, and as a causal mask on K/V expanded per query head."""
    from hflow.engine.attention import _causal_mask, masked_prefill_attention

    torch.manual_seed(0)
    q_len, ctx, d = 7, 19, 16
    q = torch.randn(q_len, heads, d)
    k, v = torch.randn(1, kv_heads, ctx, d), torch.randn(1, kv_heads, ctx, d)
    got = masked_prefill_attention(q, k, v, ctx, window, d ** -0.5)
    mask = _causal_mask(q_len, ctx, window, "cpu")
    gqa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1)
    g = heads // kv_heads
    expanded = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask,
        scale=d ** -0.5)[0].transpose(0, 1)
    torch.testing.assert_close(got, gqa, rtol=0, atol=2e-6)
    torch.testing.assert_close(got, expanded, rtol=0, atol=2e-6)


# Tensor calls that wait for the device or copy between host and device
SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "cuda", "numpy",
           "tensor", "as_tensor", "pin_memory", "copy_", "masked_select"}


def test_a_step_copies_once_each_way(saved):
    """A step sends its metadata to the device in one copy and gets its tokens back in one;
    nothing else in the step waits for the device or moves data (a function mode sees every
    tensor call). Covered: prefill with shared prompts (follower block copies), a cached
    prefix after preemption, decode buckets with and without masks, a sliding window, and
    the sampler's plain, mixed (greedy + sampled) and filtered paths. On CUDA, torch's sync
    debug mode must also see exactly one synchronising call per step."""
    import warnings

    from torch.overrides import TorchFunctionMode

    class Watch(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls, self.allowed = [], 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            kwargs = kwargs or {}
            moves = name == "to" and (kwargs.get("device") is not None or any(
                isinstance(a, (str, torch.device)) for a in args[1:]))
            # a copy_ between two tensors of one device (the sampler's scratch) moves nothing
            local = name == "copy_" and args[0].device == args[1].device
            if not self.allowed and ((name in SYNCING and not local) or moves):
                self.calls.append(name)
            return func(*args, **kwargs)

    for arch, opts in (("mistral", {}), ("llama", {"num_kv_blocks": 9})):
        path, _ = saved[arch]
        llm = LLM.from_pretrained(path, device=DEVICE, **opts)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # the cache is allocated (and sized) once
        runner, watch, steps = llm.runner, Watch(), []
        before = dict(runner.num_copies)

        def allowed(fn):
            def wrapped(*args):
                watch.allowed += 1
                try:
                    return fn(*args)
                finally:
                    watch.allowed -= 1
            return wrapped
        runner.to_device, runner.to_host = allowed(runner.to_device), allowed(runner.to_host)
        step = runner.step

        def watched_step(seqs, is_prefill):
            steps.append(is_prefill)
            with watch:
                return step(seqs, is_prefill)
        runner.step = watched_step
        base = prompts_of([40, 9, 33])
        prompts = [base[0], base[0][:20] + base[1], base[2]]
        requests = [(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=1)),
                    (prompts * 2, [SamplingParams(temperature=0, max_tokens=20),
                                   SamplingParams(n=2, temperature=0.8, max_tokens=20, seed=2)] * 3),
                    (prompts, SamplingParams(n=2, temperature=0.9, top_k=5, top_p=0.8, max_tokens=20, seed=3))]
        sync_warnings = []
        for prompts_, params in requests:
            with warnings.catch_warnings(record=True) as caught:
                if DEVICE.type == "cuda":
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    llm.generate(prompts_, params)
                finally:
                    if DEVICE.type == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
            sync_warnings += [w for w in caught if "synchroniz" in str(w.message)]
        assert watch.calls == [], watch.calls
        assert {k: v - before[k] for k, v in runner.num_copies.items()} == {"to_device": len(steps),
                                                                            "to_host": len(steps)}
        assert steps.count(False) > 3 * steps.count(True) > 0
        if arch == "llama":
            assert llm.stats()["num_preemptions"] > 0
        if DEVICE.type == "cuda":
            assert len(sync_warnings) == len(steps), [str(w.message) for w in sync_warnings[:5]]


def test_kv_blocks_for_memory():
    """The GPU budget: floor((fraction * total - used - headroom) / block_bytes), an error when
    not one block fits; on CPU the default stays min(what the sequences need, 1 GiB)."""
    from hflow.engine.config import kv_blocks_for_memory, step_activation_bytes

    gib = 1 << 30
    assert kv_blocks_for_memory(80 * gib, 20 * gib, 0.9, gib) == 52              # 72 - 20
    assert kv_blocks_for_memory(80 * gib, 20 * gib, 0.9, gib, headroom=gib // 2) == 51
    assert kv_blocks_for_memory(100, 10, 0.5, 7) == 5                            # (50 - 10) // 7
    assert kv_blocks_for_memory(100, 10, 0.5, 40) == 1
    with pytest.raises(ValueError, match=r"no KV-cache block \(41 bytes\) fits.*gpu-memory-fraction"):
        kv_blocks_for_memory(100, 10, 0.5, 41)
    with pytest.raises(ValueError, match="no KV-cache block"):
        kv_blocks_for_memory(80 * gib, 75 * gib, 0.9, 1 << 20)                   # more in use than allowed
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        EngineConfig(gpu_memory_fraction=1.5)
    cfg = tiny_config("llama")  # 4 heads x 16, 2 KV heads, intermediate 96, hidden 64, vocab 96
    per_token = (4 + 2 * 2) * 16 + 3 * 96 + 4 * 64
    assert step_activation_bytes(cfg, 100, 8, 2) == 100 * per_token * 2 + 8 * VOCAB * 32


def test_default_kv_budget_on_cpu_and_on_a_gpu(saved):
    import hflow.engine.config as engine_config

    path, _ = saved["llama"]
    if DEVICE.type == "cpu":  # 2 layers x 2 KV heads x 16 x fp32 x 2 (K, V) x 16 tokens = 8 KiB a block
        assert LLM.from_pretrained(path, device=DEVICE, max_num_seqs=4).block_manager.num_blocks == 4 * 256 // 16
        assert LLM.from_pretrained(path, device=DEVICE).block_manager.num_blocks == min(256 * 16, (1 << 30) // 8192)
        return
    # more sequences than fit: the fraction decides
    llm = LLM.from_pretrained(path, device=DEVICE, max_num_seqs=2 * 10**6, gpu_memory_fraction=0.3)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    total, used = engine_config.device_memory(DEVICE)
    used -= llm.runner.kv_cache.nbytes + llm.runner.workspace.nbytes   # what the engine's cache took
    per_block = 8192 + 8192 // 2
    headroom = engine_config.step_activation_bytes(llm.hf_config, 8192, 2 * 10**6, 4)
    expected = engine_config.kv_blocks_for_memory(total, used, 0.3, per_block, headroom)
    blocks = llm.block_manager.num_blocks
    print(f"{blocks} KV blocks on {DEVICE} (expected {expected}; {total / 2**30:.1f} GiB, {used / 2**30:.2f} used)")
    assert abs(blocks - expected) <= 0.01 * expected
    assert llm.runner.kv_cache.numel() * 4 == (blocks + 1) * 8192


def test_kv_budget_is_measured_at_each_allocation(saved, monkeypatch):
    """On a GPU the cache is sized from the memory in use when it is allocated: after a sleep,
    a process that holds more (the optimizer state after the first update) gets fewer blocks.
    Simulated on CPU with a fake device_memory."""
    import hflow.engine.kv_budget as kv_budget

    path, _ = saved["qwen2"]
    llm = LLM.from_pretrained(path, device=DEVICE)
    gib, used = 1 << 30, [10 << 30]
    monkeypatch.setattr(kv_budget, "device_memory", lambda device: (80 * gib, used[0]))
    monkeypatch.setattr(kv_budget, "step_activation_bytes", lambda *a: 0)
    llm._size_from_memory = True
    prompts, params = prompts_of([5, 20]), SamplingParams(temperature=0, max_tokens=8)
    expected = _tokens(llm.generate(prompts, params))
    per_block = 2 * 2 * 16 * 2 * 16 * 4   # K and V x 2 layers x 16 tokens x 2 KV heads x 16 x fp32
    assert llm.runner.bytes_per_block(llm.model, 16) == per_block
    per_block += per_block // 2             # and a share of the gather workspace (one layer's)
    assert llm.block_manager.num_blocks == min(256 * 16, int(0.9 * 80 * gib - used[0]) // per_block)
    llm.sleep()
    llm.wake_up()
    used[0] = int(72 * gib - 100 * per_block)
    assert _tokens(llm.generate(prompts, params)) == expected
    assert llm.block_manager.num_blocks == 100
    for fits, kept in ((104, 100), (200, 200)):   # it grows only for more than 5 %
        used[0] = int(72 * gib - fits * per_block)
        llm.sleep()
        llm.wake_up()
        llm.generate(prompts, params)
        assert llm.block_manager.num_blocks == kept
    used[0] = 72 * gib
    llm.sleep()
    llm.wake_up()
    with pytest.raises(ValueError, match="no KV-cache block"):
        llm.generate(prompts, params)


def test_weight_files_of_a_directory(tmp_path):
    """One rule for the engine and the trainer: the index's files, else model.safetensors (not a
    PEFT adapter saved beside it), else any *.safetensors; none is a clear error."""
    from safetensors.torch import save_file

    from hflow.engine.loader import safetensors_files
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        safetensors_files(str(tmp_path))
    save_file({"w": torch.zeros(1)}, str(tmp_path / "weights.safetensors"))
    assert safetensors_files(str(tmp_path)) == [str(tmp_path / "weights.safetensors")]
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    save_file({"lora_A": torch.zeros(1)}, str(tmp_path / "adapter_model.safetensors"))
    assert safetensors_files(str(tmp_path)) == [str(tmp_path / "model.safetensors")]
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "b.safetensors", "c": "a.safetensors"}}')
    assert safetensors_files(str(tmp_path)) == [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ValueError, match="model.safetensors.index.json is not JSON"):   # a ConfigError naming it
        safetensors_files(str(tmp_path))
