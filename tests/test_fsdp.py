"""FSDP2 set-up: loading, log-probs against transformers, and 1 rank == 2 ranks in training."""
import glob
import itertools
import math
import os

import pytest
import torch
from dist import PROGRAMS, torchrun
from safetensors.torch import load_file

from hflow.workers.base import check_batch_sizes, num_minibatches
from hflow.workers.optim import OptimConfig, build_optimizer
from hflow.layout import engine_outputs_to_tensors, sequence_tensors, trim_padding
from hflow.workers.micro_batches import minibatch_rows, split_micro_batches


TESTS_ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}  # scripts import these helpers


def tiny_model_dir(path, vocab=101, layers=2, hidden=64, tie=False, shard=True, seed=0, arch="qwen2"):
    """A random Llama-family model saved as a user's would be (sharded safetensors + index).
    vocab 101 does not divide by 2 or 4: the uneven-shard paths are exercised."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    Config, Model = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = Model(config)
    model.save_pretrained(str(path), max_shard_size="40KB" if shard else "10GB")
    return str(path)


def random_rollouts(batch_prompts, n, vocab, seed, max_prompt=9, max_response=7):
    """Token lists of varying lengths in the batch layout, plus advantages and old log-probs."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(batch_prompts):
        prompt = torch.randint(3, vocab, (int(torch.randint(1, max_prompt + 1, (1,), generator=g)),), generator=g)
        for _ in range(n):
            prompts.append(prompt.tolist())
            length = int(torch.randint(1, max_response + 1, (1,), generator=g))
            responses.append(torch.randint(3, vocab, (length,), generator=g).tolist())
    t = sequence_tensors(prompts, responses, pad_id=0, response_len=max_response, prompt_len=max_prompt)
    t["advantages"] = torch.randn(t["response_mask"].shape, generator=g)
    t["old_log_probs"] = -3 - torch.rand(t["response_mask"].shape, generator=g)
    return t


# ---- single-process units ------------------------------------------------------------------

def test_layout_left_pads_prompts_and_right_pads_responses():
    t = sequence_tensors([[5, 6, 7], [8]], [[9], [10, 11, 1]], pad_id=0)
    assert t["input_ids"].tolist() == [[5, 6, 7, 9, 0, 0], [0, 0, 8, 10, 11, 1]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert t["responses"].tolist() == [[9, 0, 0], [10, 11, 1]]
    assert t["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    trimmed = trim_padding({k: v[:1] for k, v in t.items()})
    assert trimmed["input_ids"].tolist() == [[5, 6, 7, 9]] and trimmed["response_mask"].tolist() == [[1]]
    with pytest.raises(ValueError, match="do not fit"):
        sequence_tensors([[1, 2]], [[3, 4, 5]], pad_id=0, response_len=2)


def test_engine_outputs_become_rows_grouped_by_prompt():
    class Sample:
        def __init__(self, ids):
            self.token_ids, self.logprobs, self.finish_reason = ids, [-0.5] * len(ids), "stop"

    class Request:
        def __init__(self, *samples):
            self.outputs = [Sample(s) for s in samples]

    t, rows = engine_outputs_to_tensors([[4, 5], [6]], [Request([7], [8, 1]), Request([9, 9, 1], [3])],
                                        pad_id=0, response_len=4)
    assert t["input_ids"].tolist() == [[4, 5, 7, 0, 0, 0], [4, 5, 8, 1, 0, 0],
                                       [0, 6, 9, 9, 1, 0], [0, 6, 3, 0, 0, 0]]
    assert t["rollout_log_probs"][2].tolist() == [-0.5, -0.5, -0.5, 0.0]
    assert rows["finish_reason"] == ["stop"] * 4


def test_minibatches_are_the_same_rows_on_any_number_of_ranks():
    rows, count = 24, 3
    one_rank = [set(r.tolist()) for r in minibatch_rows(rows, count)]
    for dp in (2, 4):
        local = rows // dp
        per_rank = [[set((r * local + minibatch_rows(local, count)[k]).tolist()) for r in range(dp)]
                    for k in range(count)]
        assert [set().union(*sets) for sets in per_rank] == one_rank


def test_batch_size_errors_name_the_flags():
    assert num_minibatches(16, 4, 2, 2, "actor") == 2
    with pytest.raises(ValueError, match="--actor.mini-batch-size 3"):
        check_batch_sizes(batch_size=4, n=2, mini_batch_size=3, dp=2)
    with pytest.raises(ValueError, match="--rollout.n 3 = 3 sequences do not split over 2 ranks"):
        check_batch_sizes(batch_size=4, n=3, mini_batch_size=1, dp=2, prefix="critic")
    with pytest.raises(ValueError, match="--data.batch-size 3"):
        check_batch_sizes(batch_size=3, n=1, mini_batch_size=0, dp=2)
    with pytest.raises(ValueError, match="--actor.mini-batch-size 8 is more than --data.batch-size 4"):
        check_batch_sizes(batch_size=4, n=2, mini_batch_size=8, dp=2)


def test_rollout_log_probs_stand_in_only_when_the_actor_computes_in_fp32():
    from hflow.workers import ActorConfig, FSDPConfig, rollout_log_probs_exact
    assert rollout_log_probs_exact(ActorConfig(), "cpu")              # auto: fp32 on CPU
    assert not rollout_log_probs_exact(ActorConfig(), "cuda")         # auto: bf16 on GPU
    assert rollout_log_probs_exact(ActorConfig(fsdp=FSDPConfig(param_dtype="float32")), "cuda")
    assert not rollout_log_probs_exact(ActorConfig(fsdp=FSDPConfig(param_dtype="bf16")), "cpu")


def test_token_budget_balances_micro_batches():
    tokens = torch.tensor([9, 1, 5, 5, 3, 7])
    parts = split_micro_batches(tokens, 3, balance=True)
    assert sorted(int(tokens[p].sum()) for p in parts) == [10, 10, 10]
    assert sorted(torch.cat(parts).tolist()) == list(range(6))


def test_learning_rate_schedules():
    model = torch.nn.Linear(2, 2)
    _, sched = build_optimizer(model, OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine",
                                                  total_steps=6, min_lr_ratio=0.1))
    lrs = []
    for _ in range(7):
        lrs.append(sched.get_last_lr()[0])
        sched.optimizer.step()
        sched.step()
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p / 4)) for p in range(5)]
    assert lrs == pytest.approx(expected)
    with pytest.raises(ValueError, match="--optim.total-steps"):
        build_optimizer(model, OptimConfig(schedule="cosine"))


def test_a_resumed_optimizer_follows_this_runs_flags_not_the_checkpoints():
    """--actor.optim.lr 1e-6 on --trainer.resume used to be logged as the checkpoint's 1e-4 and
    change nothing: the optimizer's and the schedule's state dicts carry the old values."""
    from hflow.workers.optim import apply_optim_config

    torch.manual_seed(0)
    saved_cfg = OptimConfig(lr=1e-4, warmup_steps=4, betas=(0.9, 0.999), weight_decay=0.0)
    model = torch.nn.Linear(3, 3)
    optimizer, scheduler = build_optimizer(model, saved_cfg)
    for _ in range(3):   # 3 steps into the warm-up
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}

    resumed_cfg = OptimConfig(lr=1e-6, warmup_steps=4, betas=(0.8, 0.99), weight_decay=0.01)
    optimizer, scheduler = build_optimizer(model, resumed_cfg)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-4 * 4 / 4)   # what a resume gave before
    changed = apply_optim_config(optimizer, scheduler, resumed_cfg)
    assert changed == {"lr": (1e-4, 1e-6), "betas": ((0.9, 0.999), (0.8, 0.99)), "weight_decay": (0.0, 0.01)}
    # the warm-up goes on from step 3 (factor 4/4) at this run's peak
    assert scheduler.get_last_lr()[0] == optimizer.param_groups[0]["lr"] == pytest.approx(1e-6)
    group = optimizer.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["eps"]) == ((0.8, 0.99), 0.01, 1e-8)
    assert int(optimizer.state[model.weight]["step"]) == 3   # Adam's moments and count are kept
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-6)
    assert apply_optim_config(optimizer, scheduler, resumed_cfg) == {}   # nothing left to change


# ---- multi-process ---------------------------------------------------------------------------

LOG_PROBS = os.path.join(PROGRAMS, "fsdp_log_probs.py")


@pytest.mark.dist
@pytest.mark.parametrize("tie", [False, True])
def test_log_probs_equal_transformers_forward(tmp_path, tie):
    path = tiny_model_dir(tmp_path / "model", tie=tie)
    run = torchrun(LOG_PROBS, nproc=2, args=[path], tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    assert run.output.count("diff") == 2


TRAIN = os.path.join(PROGRAMS, "fsdp_train.py")


@pytest.mark.dist
def test_one_rank_and_two_ranks_train_the_same(tmp_path):
    """FSDP2 changes the layout, not the math: same losses and weights after 3 updates
    (8 sequences of varying lengths, 2 mini-batches x 2 epochs each, clipping, a schedule,
    different micro-batching, activation checkpointing on one side), for token-mean and
    seq-mean losses; with the parameters sharded over the 2 ranks or replicated on each."""
    path = tiny_model_dir(tmp_path / "model")
    # 2 ranks: parameters sharded over both (FSDP), and replicated on each (HSDP, shard size 1)
    runs = {"one": (1, 1), "sharded": (2, 2), "replicated": (2, 1)}
    for name, (world, shard_size) in runs.items():
        torchrun(TRAIN, nproc=world, args=[path, tmp_path / f"{name}.pt", shard_size],
                 tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    start = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        start |= load_file(f)
    for agg, two_ranks in itertools.product(("token-mean", "seq-mean-token-mean"), ("sharded", "replicated")):
        one, two = (torch.load(tmp_path / f"{name}.pt")[agg] for name in ("one", two_ranks))
        for m1, m2 in zip(one["metrics"], two["metrics"]):
            assert m1.keys() == m2.keys() == {"actor/loss", "actor/clipfrac", "actor/grad_norm", "actor/lr",
                                              "actor/skipped_steps", "memory/actor_peak_gib"}
            for key in m1.keys() - {"memory/actor_peak_gib"}:   # the processes differ
                assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), (key, m1, m2)
        assert max(m["actor/grad_norm"] for m in one["metrics"]) > 0.5  # clipping was active
        moved = 0.0
        for name, w1 in one["weights"].items():
            moved = max(moved, (w1 - start[name]).abs().max().item())
            if name.endswith("k_proj.bias"):
                # Its gradient is exactly 0 in exact arithmetic (a key bias shifts all of a
                # query's scores equally): Adam's normalisation turns rounding noise into steps.
                continue
            # fp32 rounding in the reductions and the log-probs differs with the rank count, and
            # Adam's normalisation amplifies it where a gradient element is near 0: the worst
            # element reached 2.1e-5 (1.35e-6 to 7.9e-6 before the log-probs had a backward of
            # their own), so each element within 1e-4, a hundredth of one Adam step (lr 1e-2),
            # and each tensor within 1e-6 on average; a wrong update moves weights by
            # ~lr a step
            torch.testing.assert_close(w1, two["weights"][name], rtol=1e-5, atol=1e-4)
            assert (w1 - two["weights"][name]).abs().mean() < 1e-6, name   # 2.1e-7 at most, measured
        assert moved > 1e-3, "training did not change the weights"


LOSS_AGG = os.path.join(PROGRAMS, "fsdp_loss_agg.py")


def whole_batch_gradient(path, batch, agg):
    """The oracle: transformers' own forward on the whole (padded) mini-batch, the on-policy
    PPO loss -A·π/sg(π) per token, aggregated by hand, and its gradient."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    mask, adv = batch["response_mask"], batch["advantages"]
    P = batch["input_ids"].shape[1] - mask.shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, batch["responses"][..., None])[..., 0]
    per_token = -adv * torch.exp(logp - logp.detach()) * mask
    if agg == "token-mean":
        loss = per_token.sum() / mask.sum()
    elif agg == "seq-mean-token-sum":
        loss = per_token.sum(-1).mean()
    else:
        loss = (per_token.sum(-1) / mask.sum(-1)).mean()
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.dist
@pytest.mark.parametrize("tie", [False, True])
def test_every_micro_batching_and_rank_count_gives_the_aggregation_asked_for(tmp_path, tie):
    """Sequences of 1 to 7 tokens: the gradient of one update with micro-batches of 1, 2 or all
    sequences, on 1 and on 2 ranks, equals the gradient of the whole mini-batch's loss for each
    aggregation (token-mean: a mean over tokens; seq-mean-*: a mean over sequences). Tied: the
    embedding's part of the shared weight's gradient goes in place into the head's
    (hf_model._embedding_grad_into_head_grad), against autograd's own sum in the oracle."""
    from hflow import algos

    path = tiny_model_dir(tmp_path / "model", tie=tie)
    runs = {}
    for world in (1, 2):
        torchrun(LOSS_AGG, nproc=world, args=[path, tmp_path / f"agg{world}.pt"],
                 tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
        runs[world] = torch.load(tmp_path / f"agg{world}.pt")
    batch = random_rollouts(4, 2, 101, seed=30)
    assert len(set(batch["response_mask"].sum(-1).tolist())) > 3   # uneven lengths
    for agg in algos.AGG_MODES:
        oracle = whole_batch_gradient(path, batch, agg)
        for world, saved in runs.items():
            for micro in (1, 2, "all"):
                grads = saved[agg, micro]
                assert grads.keys() == oracle.keys()
                for name, grad in grads.items():
                    torch.testing.assert_close(grad, oracle[name], rtol=1e-4, atol=1e-6,
                                               msg=lambda m: f"{agg}, {world} ranks, micro-batch {micro}, {name}: {m}")


def test_a_batch_cut_short_trains_on_the_most_prompts_that_split():
    from hflow.workers.base import trainable_prompts
    assert trainable_prompts(5, n=2, mini_batch_size=0, dp=2) == 5     # 10 sequences over 2 ranks
    assert trainable_prompts(5, n=1, mini_batch_size=0, dp=2) == 4     # 5 do not split over 2 ranks
    assert trainable_prompts(5, n=1, mini_batch_size=2, dp=2) == 4     # 2 mini-batches of 2
    assert trainable_prompts(3, n=2, mini_batch_size=8, dp=2) == 3     # less than a mini-batch: one
    assert trainable_prompts(7, n=2, mini_batch_size=3, dp=2) == 6
    assert trainable_prompts(1, n=1, mini_batch_size=0, dp=2) == 0
    assert num_minibatches(6, 2, 8, 2, "actor") == 1


ON_POLICY = os.path.join(PROGRAMS, "fsdp_on_policy.py")


@pytest.mark.dist
def test_on_policy_update_skips_the_old_log_probs_pass(tmp_path):
    """Without old_log_probs an on-policy update uses its own detached log-probs: the same
    update as recomputing them first, on 1 and on 2 ranks; an off-policy one refuses. A *_max
    metric is reduced by max."""
    path = tiny_model_dir(tmp_path / "model")
    runs = {}
    for world in (1, 2):
        torchrun(ON_POLICY, nproc=world, args=[path, tmp_path / f"on{world}.pt"],
                 tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
        runs[world] = torch.load(tmp_path / f"on{world}.pt")
    weights = sum(t.nbytes for f in glob.glob(f"{path}/*.safetensors") for t in load_file(f).values())
    assert runs[1]["received"] == 0
    # 2 ranks, 2 micro-batches of 3 + 1 rows each, the weights replicated on each rank (the CPU
    # default at this size): each micro-batch's backward all-reduces the gradients, a rank
    # receiving half of them twice (ring: reduce, then gather), plus a few small all-reduces
    assert 2.0 * weights <= runs[2]["received"] <= 2.05 * weights, (runs[2]["received"], weights)
    for world, run in runs.items():
        assert "only an on-policy update" in run["error"]
        for recomputed, skipped in zip(run["recompute"], run["skip"]):
            assert skipped["actor/ratio_dev"] == 0.0          # the ratio is exactly 1
            assert recomputed["actor/ratio_dev"] < 1e-6
            for key in ("actor/loss", "actor/grad_norm"):
                assert skipped[key] == pytest.approx(recomputed[key], rel=1e-6, abs=1e-7), (world, key)
        # a metric named *_max is the maximum over micro-batches and ranks, not their mean
        assert [m["actor/advantage_max"] for m in run["skip"]] == pytest.approx(run["advantage_max"])
        for name, w in run["skip_weights"].items():
            torch.testing.assert_close(w, run["recompute_weights"][name], rtol=1e-6, atol=1e-7)
    # 1 rank == 2 ranks (the weights themselves: test_one_rank_and_two_ranks_train_the_same;
    # here Adam's first full-lr step would turn rounding noise in near-zero gradients into lr-sized steps)
    for m1, m2 in zip(runs[1]["skip"], runs[2]["skip"]):
        for key in ("actor/loss", "actor/grad_norm"):
            assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), key


def test_token_budget_keeps_the_samples_of_a_prompt_in_one_micro_batch():
    from hflow.layout import sequence_tensors
    from hflow.workers.micro_batches import packed_tokens, prompt_groups
    prompts = [[5] * 10, [6] * 3, [7] * 20]
    which = [0, 0, 1, 2, 1, 2, 0, 2]
    t = sequence_tensors([prompts[w] for w in which], [[9] * r for r in (4, 8, 2, 6, 1, 3, 5, 7)], pad_id=0)
    groups = prompt_groups(t)
    # a prompt counts on the first row that has it
    assert packed_tokens(t, groups).tolist() == [14, 8, 5, 26, 1, 3, 5, 7]
    parts = split_micro_batches(packed_tokens(t, groups), 2, balance=True, groups=groups)
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    for part in parts:
        for i in part.tolist():
            assert all(j in part.tolist() for j in range(8) if which[j] == which[i])


def test_a_prompt_with_more_samples_than_the_budget_holds_is_cut_into_runs_that_fit():
    from hflow.layout import sequence_tensors
    from hflow.workers.micro_batches import budget_groups, micro_batch_count, packed_tokens
    t = sequence_tensors([[5] * 10] * 6 + [[6] * 4], [[9] * 20] * 6 + [[9] * 3], pad_id=0)
    groups = budget_groups(t, 60)
    assert groups[:6].tolist() == [groups[0]] * 2 + [groups[2]] * 2 + [groups[4]] * 2   # runs of 2 rows
    assert len(set(groups.tolist())) == 4
    tokens = packed_tokens(t, groups)
    assert tokens.tolist() == [30, 20, 30, 20, 30, 20, 7]   # each run's first row carries the prompt
    count = micro_batch_count(tokens, 0, 60, row_tokens=t["attention_mask"].sum(-1))
    parts = split_micro_batches(tokens, count, balance=True, groups=groups)
    assert max(int(tokens[p].sum()) for p in parts) <= 60
    for budget in (0, 10**6):   # no budget, or a large one: whole groups
        whole = budget_groups(t, budget).tolist()
        assert len(set(whole[:6])) == 1 and whole[6] != whole[0]
    with pytest.raises(ValueError, match="exceeds the micro-batch token budget"):
        micro_batch_count(tokens, 0, 25, row_tokens=t["attention_mask"].sum(-1))   # a 30-token row


def test_shard_size_auto_replicates_on_cpu_while_the_copies_fit():
    from hflow.workers.fsdp import FSDPConfig, resolve_shard_size

    cpu, gpu, GiB = torch.device("cpu"), torch.device("cuda", 0), 2**30
    auto = FSDPConfig()
    # 25M parameters trained: 16 bytes each = 400 MB a copy; 2 copies fit in a quarter of 24 GiB
    assert resolve_shard_size(auto, 2, cpu, 400 * 10**6, host_bytes=24 * GiB, ranks_on_host=2) == 1
    # 1.5B trained on 4 ranks: 4 x 24 GB does not fit: shard over all
    assert resolve_shard_size(auto, 4, cpu, 24 * 10**9, host_bytes=24 * GiB, ranks_on_host=4) == 4
    # the boundary: the host's ranks' copies at most a quarter of its memory
    assert resolve_shard_size(auto, 2, cpu, 3 * GiB, host_bytes=24 * GiB, ranks_on_host=2) == 1
    assert resolve_shard_size(auto, 2, cpu, 3 * GiB + 1, host_bytes=24 * GiB, ranks_on_host=2) == 2
    assert resolve_shard_size(auto, 8, gpu, 1000) == 8      # GPUs: sharded, whatever the size
    assert resolve_shard_size(FSDPConfig(shard_size=2), 4, cpu, 1000) == 2
    assert resolve_shard_size(FSDPConfig(shard_size=1), 4, gpu, 1000) == 1
    for bad in (3, -1, 8):
        with pytest.raises(ValueError, match="shard-size"):
            resolve_shard_size(FSDPConfig(shard_size=bad), 4, cpu, 1000)


def test_training_state_bytes_counts_adam_for_trained_and_weights_for_frozen():
    from hflow.workers.fsdp import training_state_bytes

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2).to(torch.bfloat16))
    model[1].requires_grad_(False)
    assert training_state_bytes(model) == 110 * 16 + 22 * 2


def test_a_shard_size_that_does_not_divide_the_ranks_is_refused_before_spawning():
    from hflow.validation import ConfigError
    from hflow.workers import Actor, ActorConfig, Critic, CriticConfig, FSDPConfig, Reference

    for worker, cfg, flag in [(Actor, ActorConfig, "--actor"), (Reference, ActorConfig, "--actor"),
                              (Critic, CriticConfig, "--critic")]:
        with pytest.raises(ConfigError, match=f"^{flag}.fsdp.shard-size 2: does not divide the 3 ranks"):
            worker.check_arguments(3, cfg(fsdp=FSDPConfig(shard_size=2)))
        worker.check_arguments(4, cfg(fsdp=FSDPConfig(shard_size=2)))
        worker.check_arguments(3, cfg())   # auto: whatever the ranks


@pytest.mark.parametrize("change", [{"intermediate_size": 96, "vocab_size": 64},   # weights larger than the config
                                    {"intermediate_size": 256}])                  # smaller
def test_a_config_that_disagrees_with_its_weights_is_refused_with_the_tensor_and_both_shapes(tmp_path, change):
    # A smaller config used to be loaded by slicing each tensor to the configured shape: the run
    # trained to exit 0 with reward 0. The loader must name the tensor, its file and both shapes.
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from hflow.workers.hf_model import load_hf_weights

    path = tiny_model_dir(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, **change}))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match=r"has shape \(\d+, \d+\) in model-\d+-of-\d+\.safetensors but \(\d+, \d+\) "
                                         r"by config.json; the config does not describe these weights") as error:
        load_hf_weights(model, path)
    assert "model." in str(error.value) or "lm_head" in str(error.value)


def test_reused_buffers_hand_a_buffer_out_again_only_once_nothing_holds_it():
    """FSDP2's communication buffers on CPU (cpu_collectives.py ReusedBuffers): the same storage
    again once the caller dropped what it was given and every view of it, never while anything
    holds it, and no more kept than the bound."""
    from hflow.distributed.cpu_collectives import ReusedBuffers

    cpu = torch.device("cpu")
    pool = ReusedBuffers(max_bytes=1024)
    a = pool.allocate((64,), dtype=torch.float32, device=cpu)   # 256 bytes, kept
    first = a.data_ptr()
    held = pool.allocate((64,), dtype=torch.float32, device=cpu)
    assert held.data_ptr() != first                                # the caller still holds a
    view = a[8:]
    del a
    assert pool.allocate((64,), dtype=torch.float32, device=cpu).data_ptr() != first   # a view holds it
    del view
    again = pool.allocate((64,), dtype=torch.float32, device=cpu)
    assert again.data_ptr() == first                               # nothing holds it: reused
    assert pool.allocate((64,), dtype=torch.bfloat16, device=cpu).dtype == torch.bfloat16
    assert pool.allocate((32,), dtype=torch.float32, device=cpu).shape == (32,)
    assert sum(t.numel() * t.element_size() for t in pool.kept) <= 1024
    kept = len(pool.kept)
    big = pool.allocate((1024,), dtype=torch.float32, device=cpu)  # 4 KiB: over the bound
    assert len(pool.kept) == kept and big.shape == (1024,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_embedding_adds_its_gradient_into_the_heads_as_autograd_would(tmp_path, dtype):
    """The lookup's gradient added row by row into the tied weight's gradient (in place of
    autograd's dense embedding gradient and out-of-place sum) equals autograd's: repeated
    tokens summed, the padding token's row left out, in fp32 and bf16 (there as close to the
    exact sum of the two parts as autograd's, or closer); untied models keep autograd's path."""
    from transformers import AutoModelForCausalLM

    from hflow.workers.hf_model import _embedding_grad_into_head_grad, tied_plain_embedding

    path = tiny_model_dir(tmp_path / "model", tie=True)
    ids = torch.tensor([[5, 9, 0, 5, 7, 9, 5, 0, 100, 3]])   # repeats, and the padding id 0 inside
    grads, parts = [], {}
    for hooked in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        emb = model.get_input_embeddings()
        assert tied_plain_embedding(model) and emb.padding_idx == 0
        if hooked:
            def capture(module, args, output):   # the lookup's part, for the exact sum
                out = _embedding_grad_into_head_grad(module, args, output)
                out.register_hook(lambda g: parts.update(rows=g[0].double()))
                return out
            emb.register_forward_hook(capture)
            # the head's part: what AccumulateGrad stores before the lookup's gradient arrives
            emb.weight.register_post_accumulate_grad_hook(lambda w: parts.update(head=w.grad.double()))
        logits = model(input_ids=ids).logits.float()
        (torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None]) * torch.arange(9.0)[:, None]).sum().backward()
        grads.append(emb.weight.grad)
    autograd, hooked = grads
    assert autograd[5].abs().sum() > 0 and autograd[0].abs().sum() > 0   # rows the lookup and the head both reach
    if dtype == torch.float32:
        torch.testing.assert_close(hooked, autograd, rtol=1e-6, atol=1e-7)
    else:
        # a token looked up once: the same bf16 sum of the head's part and its row, bit for bit
        repeated = [5, 9]
        once = torch.tensor([t for t in range(autograd.shape[0]) if t not in repeated])
        assert torch.equal(hooked[once], autograd[once])
        # repeated tokens: their rows summed in fp32 here, in bf16 by autograd
        keep = ids[0] != 0
        rows = torch.zeros_like(parts["head"]).index_add(0, ids[0][keep], parts["rows"][keep])[repeated]
        exact = parts["head"][repeated] + rows
        ours, theirs = (hooked[repeated].double() - exact).abs(), (autograd[repeated].double() - exact).abs()
        # two bf16 roundings: of the rows' fp32 sum, then of its sum with the head's part
        assert (ours <= (rows.abs() + exact.abs()) * 2**-8).all(), (ours / (rows.abs() + exact.abs())).max()
        assert ours.sum() <= theirs.sum(), (ours.sum(), theirs.sum())
    untied = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path / "untied", tie=False))
    assert not tied_plain_embedding(untied)
