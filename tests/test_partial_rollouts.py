"""Partial rollouts (--trainer.partial-rollouts): weights loaded between two engine steps
recompute the running sequences' KV, each token's log-prob is that of the weights that sampled
it (transformers' forward and the trainer as oracles), the versions per token are recorded, and
the flags a run cannot honour are refused."""
import pytest
import torch

from dist import PROGRAMS, torchrun
from hflow.engine import SamplingParams
from test_async import PARITY, staleness_run
import test_engine as engine
from test_recipes import RECIPES, small_run, tiny_model  # noqa: F401 (fixture)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_weights_loaded_between_steps_continue_each_response_on_them(arch):
    """After 4 steps the engine is given other weights: the tokens before come from the first
    model, those after from the second, computed afresh (a stale KV cache would not match the
    second model's own forward), and each unfinished completion says where the change was."""
    first, second = engine.tiny_model(arch, seed=0), engine.tiny_model(arch, seed=1)
    llm = engine.engine_of(first)
    steps = 0

    def swap():
        nonlocal steps
        steps += 1
        if steps == 4:
            llm.load_weights(second.state_dict().items())

    prompts = engine.prompts_of([3, 17, 40], seed=2)
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=4), between_steps=swap)
    changed = 0
    for prompt, out in zip(prompts, outs):
        for sample in out.outputs:
            tokens, logprobs = sample.token_ids, torch.tensor(sample.logprobs)
            # every sequence got its first token in the first (prefill) step and one a step after
            assert sample.weight_changes == ([4] if len(tokens) > 4 else []), (len(tokens), sample.weight_changes)
            before = engine.reference_logprobs(first, prompt, tokens)
            after = engine.reference_logprobs(second, prompt, tokens)
            at = sample.weight_changes[0] if sample.weight_changes else len(tokens)
            assert (logprobs[:at] - before[:at]).abs().max() < 1e-4
            if at < len(tokens):
                assert (logprobs[at:] - after[at:]).abs().max() < 1e-4
                assert (before[at:] - after[at:]).abs().max() > 1e-2   # the oracle tells the two apart
                changed += 1
    assert changed >= 3
    assert llm.block_manager.num_used_blocks == 0   # every block freed, the engine idle again
    # new weights with nothing running: no change recorded, as before
    assert all(not s.weight_changes for o in llm.generate(prompts, SamplingParams(max_tokens=8, seed=1))
               for s in o.outputs)


@pytest.mark.dist
def test_a_push_during_a_generation_is_taken_between_its_steps(tiny_model):
    """The trainer's own log-probs as the oracle: tokens sampled before the push by version 0
    (a frozen copy of the start), after it by version 1 (the actor); the engine then holds version
    1 bit for bit, and the push's queued receive finds it done."""
    run = torchrun(f"{PROGRAMS}/partial_rollout.py", 2, [tiny_model], timeout=300).check()
    assert "after the partial rollout: " in run.output and "equal bit for bit" in run.output, run.output


@pytest.mark.dist
def test_an_async_run_with_partial_rollouts_keeps_the_bound_and_records_token_versions(tiny_model, tmp_path):
    logged = staleness_run(tiny_model, tmp_path / "out", 2, 5, "--trainer.partial-rollouts",
                           "--rollout.max-tokens", 24)
    for row in logged:
        step = row["step"]
        # a row's first token comes from version >= step - 1 - k; later tokens may be newer
        assert row["step"] - 1 - 2 <= row["async/policy_version"] <= step - 1, row
        assert row["async/staleness_max"] <= 2 and row["async/dropped_stale"] == 0
        assert 0 <= row["async/token_staleness_mean"] <= row["async/staleness_mean"] + 1e-9, row
        assert 0 <= row["async/partial_fraction"] <= 1
    assert any(row["actor/grad_norm"] > 0 for row in logged)


@pytest.mark.dist
@pytest.mark.parametrize("extra, expected", [
    (["--trainer.async-steps", "0", "--trainer.placement", "actor:0;rollout:1"], "needs --trainer.async-steps 1"),
    (["--trainer.async-steps", "1", "--trainer.placement", "actor:0;rollout:1", "--rollout.tp-size", "2"],
     "--rollout.tp-size > 1 is not supported"),
])
def test_partial_rollouts_a_run_cannot_honour_are_refused_before_work(tiny_model, tmp_path, extra, expected):
    run = torchrun(str(RECIPES / "grpo.py"), 2, small_run(tiny_model, tmp_path / "out", 2, *PARITY,
                                                          "--trainer.partial-rollouts", *extra), timeout=200)
    assert run.returncode != 0 and expected in run.output, run.output
