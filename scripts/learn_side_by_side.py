"""Does GRPO learn, and how fast: hflow's recipes/grpo.py against TRL 1.16's GRPOTrainer on the
same model, data, hyperparameters and evaluator, seed by seed.

    python scripts/learn_side_by_side.py --model-path ~/models/SmolLM2-135M-Instruct --out outputs/lsbs
    python scripts/learn_side_by_side.py --model-path DIR --steps 2 --batch 2 --n 4 --max-tokens 16 \
        --eval-size 8 --eval-every 1 --seeds 0 --out /tmp/lsbs_smoke          # a smoke test (minutes)
    python scripts/learn_side_by_side.py --model-path DIR --sides distill --teacher GRPO_DIR/actor_hf
                        # recipes/distill.py from the same start towards a GRPO-trained teacher (issue 47)

Measures, per seed and side: held-out greedy accuracy (step -> accuracy) at step 0, every
--eval-every steps and at the end; the RL's wall time without evaluation (hflow: the sum of its
time/step_s; TRL: the sum of on_step_begin..on_step_end); per-phase medians (generate = sampling
and scoring, update = the rest of the step); generated tokens/s (EOS included) over that time;
peak memory of a process (hflow: memory/actor_peak_gib, the largest of its ranks; TRL: its one
process; both hflow.distributed.byte_counters.peak_memory_gib); and the greedy responses to the first --samples
held-out prompts before and after. Written to <out>/summary.json; a table and, last, the mean +-
std over seeds of (final - start) accuracy per side and the wall-time ratio hflow / TRL.

Data: `task_splits(--task, --task-seed, --eval-size, --task-size, --task-args)` (default rg:chain_sum,
2 terms of 1-2 digits): chat prompts (one user message) with the model's chat template; hflow
gets the same through --data.task*. Training order: hflow shuffles per epoch with
permutation(default_rng([--data.seed, epoch])) (hflow.data.sampler); this script computes that
order and gives TRL its rows in it (shuffle_dataset=False), so both see the same prompts at the
same step. Reward: hflow.rewards.reasoning_gym.reasoning_gym_score on both (TRL: wrapped,
completion message content). Evaluation: ONE evaluator (`Evaluator`): hflow's engine, greedy,
fp32, <= --max-tokens tokens, on the held-out prompts rendered with the chat template and scored
by the same function. hflow evaluates itself (eval/reward_mean, the same rows and max tokens);
the evaluator re-scores hflow's starting model and its exported actor_hf as a cross-check
(`check` in the summary). TRL saves a model every --eval-every steps; the evaluator scores them.

Hyperparameters (this script's flag: hflow flag = TRL GRPOConfig argument):
    --model-path      --model.path                       = GRPOTrainer(model=from_pretrained(fp32))
    --batch 16        --data.batch-size                  = generation_batch_size = batch * n
                                                           (per_device_train_batch_size --trl-micro-batch
                                                           x gradient_accumulation_steps; steps_per_generation
                                                           = gradient_accumulation_steps: one generation and
                                                           one optimizer step per batch)
    --n 8             --rollout.n                        = num_generations
    --max-tokens 48   --rollout.max-tokens               = max_completion_length
    --temperature 0.7 --rollout.temperature              = temperature (top_p 1, top_k 0 both)
    --lr 1e-5         --actor.optim.lr (constant, no     = learning_rate, lr_scheduler_type constant,
                      warm-up: the defaults)               warmup_steps 0
    --beta 0          --algo.kl-coef                     = beta (0: no reference model on either)
    (fixed)           --algo.estimator grpo              = scale_rewards "group"
                      clip 0.2/0.2 (ppo loss default)    = epsilon 0.2 (epsilon_high = epsilon)
                      token-mean over the batch          = loss_type "dapo" (token mean over the whole
                                                           accumulated batch; "bnpo" is per micro-batch)
                      epochs 1, mini-batch = batch       = num_iterations 1 (on-policy: no old log-probs)
                      no overlong filtering (none)       = mask_truncated_completions False
                      --actor.fsdp.param-dtype float32   = bf16 False
                      no activation checkpointing        = gradient_checkpointing False
                      --actor.optim.grad-clip 1.0        = max_grad_norm 1.0
                      AdamW (0.9, 0.999), eps 1e-8, wd 0 = transformers' defaults (the same)
    --seeds           --rollout.seed, --data.seed        = seed (TRL's order is hflow's, above)
    processes         torchrun 2 ranks, OMP_NUM_THREADS=1 = 1 process, torch.set_num_threads(2)
Not identical: the group-std epsilon (hflow 1e-6, TRL 1e-4; only tells when a group's std is
~0, where both advantages are 0); the sampling itself (same seed, different generators: TRL's
model.generate, hflow's engine), so the trajectories differ from step 1 on; with --beta > 0 the
KL (hflow: low_var_kl, k3 clamped to [-10, 10], TRL: k3). --hflow-args "..." appends hflow flags
(variants); hflow's own evaluation also runs one sampled pass (eval/reward_mean_sampled), which
is excluded from its time like every evaluation.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
TASK_ARGS = ["min_terms=2", "max_terms=2", "min_digits=1", "max_digits=2"]


def score(text: str, answer, extra: dict) -> float:
    """The reasoning_gym reward of one response: what hflow's --reward.fn reasoning_gym gives."""
    from hflow.rewards.reasoning_gym import reasoning_gym_score
    return float(reasoning_gym_score(text, answer, **extra)["score"])


def trl_reward(completions, answer, question, metadata, task_config, **_) -> list[float]:
    """TRL reward function: conversational completions are [{"role": "assistant", "content": ...}]."""
    return [score(c[-1]["content"] if isinstance(c, list) else c, a,
                  {"question": q, "metadata": m, "task_config": t})
            for c, a, q, m, t in zip(completions, answer, question, metadata, task_config)]


def splits(a):
    from hflow.data.tasks import task_splits
    return task_splits(a.task, seed=a.task_seed, eval_size=a.eval_size, size=a.task_size, args=tuple(a.task_args))


def hflow_order(rows: int, batch: int, steps: int, seed: int) -> list[int]:
    """The row indices hflow's PromptSampler (shuffle on, drop-last) yields over `steps` batches."""
    import numpy as np
    per_epoch, order = rows // batch, []
    for k in range(steps):
        epoch, pos = divmod(k, per_epoch)
        order += np.random.default_rng([seed, epoch]).permutation(rows)[pos * batch:(pos + 1) * batch].tolist()
    return order


class Evaluator:
    """Greedy accuracy of a Hugging Face directory on the held-out rows: hflow's engine, fp32,
    the prompts rendered as hflow.data.loading renders them, scored by `score`."""

    def __init__(self, a, held_out: list[dict]):
        from transformers import AutoTokenizer
        self.tok, self.rows, self.max_tokens = AutoTokenizer.from_pretrained(a.model_path), held_out, a.max_tokens
        texts = [self.tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in held_out]
        self.ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        self.seconds = 0.0

    def __call__(self, model_dir) -> tuple[float, list[str], list[float]]:
        import torch
        from hflow.engine import LLM, SamplingParams
        start = time.perf_counter()
        llm = LLM.from_pretrained(str(model_dir), dtype=torch.float32)
        outs = llm.generate(self.ids, SamplingParams(n=1, temperature=0.0, max_tokens=self.max_tokens))
        texts = self.tok.batch_decode([o.outputs[0].token_ids for o in outs], skip_special_tokens=True)
        scores = [score(t, r["answer"], r["extra"]) for t, r in zip(texts, self.rows)]
        self.seconds += time.perf_counter() - start
        return sum(scores) / len(scores), texts, scores


def run_logged(cmd: list[str], env: dict, log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"exit status {rc}: {shlex.join(cmd)}\n--- {log} (tail)\n" + log.read_text()[-4000:])
    return time.perf_counter() - start


def median(rows, key):
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def run_hflow(a, seed: int, out: Path, recipe: str = "grpo") -> dict:
    """recipes/grpo.py, or with `recipe` "distill" recipes/distill.py towards --teacher: the same
    data, sampling, optimizer and evaluation flags, the algorithm's own flags apart."""
    own = (["--distill.teacher", a.teacher] if recipe == "distill" else
           ["--algo.estimator", "grpo", "--algo.kl-coef", str(a.beta)])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", f"recipes/{recipe}.py",
           "--model.path", a.model_path, "--data.task", a.task, "--data.task-args", *a.task_args,
           "--data.task-seed", str(a.task_seed), "--data.task-size", str(a.task_size),
           "--data.task-eval-size", str(a.eval_size), "--data.seed", str(seed), "--data.batch-size", str(a.batch),
           "--rollout.n", str(a.n), "--rollout.max-tokens", str(a.max_tokens), "--rollout.temperature",
           str(a.temperature), "--rollout.seed", str(seed), "--actor.optim.lr", str(a.lr),
           "--actor.optim.grad-clip", "1.0", "--actor.fsdp.param-dtype", "float32", *own,
           "--reward.fn", "reasoning_gym", "--trainer.steps", str(a.steps),
           "--trainer.eval-every", str(a.eval_every), "--trainer.eval-size", str(a.eval_size),
           "--trainer.output-dir", str(out), "--trainer.overwrite", "--rollout.no-progress",
           "--trainer.logging.no-progress-bars", *shlex.split(a.hflow_args)]
    wall = run_logged(cmd, {"OMP_NUM_THREADS": "1"}, out.parent / "hflow.log")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "time/step_s" in r]
    tokens = sum(r["response_length/mean"] * a.batch * a.n for r in steps)
    rl = sum(r["time/step_s"] for r in steps)
    return {"curve": {r["step"]: r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r},
            "teacher_kl": {r["step"]: r["eval/teacher_kl"] for r in rows if "eval/teacher_kl" in r},
            "rl_wall_s": rl, "process_wall_s": wall, "steps": len(steps),
            "phase_median_s": {"generate": median(steps, "time/generate_s"), "update": median(steps, "time/update_s"),
                               "step": median(steps, "time/step_s")},
            "tokens_per_s": tokens / rl, "peak_gib": max(r.get("memory/actor_peak_gib", 0.0) for r in steps),
            "final_model": str(out / "actor_hf")}


def run_trl(a, seed: int, out: Path, train: list[dict]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows = [train[i] for i in hflow_order(len(train), a.batch, a.steps, seed)]
    with open(out / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": r["prompt"], "answer": r["answer"], **r["extra"]}) + "\n" for r in rows)
    (out / "spec.json").write_text(json.dumps({**vars(a), "seed": seed, "out": str(out)}))
    wall = run_logged([sys.executable, __file__, "--trl-worker", str(out / "spec.json")],
                      {"OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO / "src")}, out.parent / "trl.log")
    steps = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rl = sum(r["time/step_s"] for r in steps)
    checkpoints = {int(p.name.split("-")[1]): p for p in out.glob("checkpoint-*")}
    return {"rl_wall_s": rl, "process_wall_s": wall, "steps": len(steps),
            "phase_median_s": {"generate": median(steps, "time/generate_s"), "update": median(steps, "time/update_s"),
                               "step": median(steps, "time/step_s"), "engine": median(steps, "time/engine_s")},
            "tokens_per_s": sum(r["tokens"] for r in steps) / rl, "peak_gib": max(r["peak_gib"] for r in steps),
            "prompt_ids_match": all(r["prompt_ids_match"] for r in steps if "prompt_ids_match" in r),
            "checkpoints": {k: str(p) for k, p in sorted(checkpoints.items())},
            "final_model": str(checkpoints[max(checkpoints)])}


def trl_worker(spec_path: str) -> None:
    """Child process: TRL's GRPOTrainer; one metrics row per optimizer step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from hflow.distributed.byte_counters import peak_memory_gib

    a = argparse.Namespace(**json.loads(Path(spec_path).read_text()))
    torch.set_num_threads(2)
    rows = [json.loads(line) for line in open(Path(a.out) / "train.jsonl")]
    tok = AutoTokenizer.from_pretrained(a.model_path)
    micro = min(a.trl_micro_batch, a.batch * a.n)
    if (a.batch * a.n) % micro:
        raise SystemExit(f"--trl-micro-batch {micro} must divide batch * n = {a.batch * a.n}")
    args = GRPOConfig(output_dir=a.out, per_device_train_batch_size=micro,
                      gradient_accumulation_steps=a.batch * a.n // micro, num_generations=a.n,
                      max_completion_length=a.max_tokens, temperature=a.temperature, top_p=1.0, top_k=0,
                      num_iterations=1, beta=a.beta, epsilon=0.2, loss_type="dapo", scale_rewards="group",
                      mask_truncated_completions=False, learning_rate=a.lr, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                      max_grad_norm=1.0, max_steps=a.steps, seed=a.seed, bf16=False, gradient_checkpointing=False,
                      use_vllm=False, shuffle_dataset=False, use_cpu=True, report_to="none",
                      save_strategy="steps", save_steps=a.eval_every or a.steps, save_only_model=True,
                      logging_steps=1, disable_tqdm=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(a.model_path, dtype=torch.float32),
                          reward_funcs=trl_reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok)
    acc: dict = {}
    position = [0]   # rows consumed: TRL's prompts checked against hflow's rendering of the same rows

    def timed(name, fn, after=None):
        def wrapper(*args_, **kw):
            start = time.perf_counter()
            out = fn(*args_, **kw)
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - start
            if after:
                after(out)
            return out
        return wrapper

    def count(out):   # _generate's (prompt_ids, completion_ids, ...); a prompt repeated n times
        acc["tokens"] = acc.get("tokens", 0) + sum(map(len, out[1]))
        prompts = [list(p) for p in out[0][::a.n]]
        mine = rows[position[0]:position[0] + len(prompts)]
        texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in mine]
        acc["prompt_ids_match"] = prompts == tok(texts, add_special_tokens=False)["input_ids"]
        position[0] += len(prompts)

    trainer._generate = timed("engine", trainer._generate, count)
    trainer._generate_and_score_completions = timed("generate", trainer._generate_and_score_completions)
    log = open(Path(a.out) / "metrics.jsonl", "w")

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            acc.clear()
            acc["start"] = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            step = time.perf_counter() - acc["start"]
            log.write(json.dumps({"step": state.global_step, "time/step_s": step, "time/generate_s": acc["generate"],
                                  "time/engine_s": acc["engine"], "time/update_s": step - acc["generate"],
                                  "tokens": acc["tokens"], "prompt_ids_match": acc["prompt_ids_match"],
                                  "peak_gib": peak_memory_gib(torch.device("cpu"))}) + "\n")
            log.flush()

    trainer.add_callback(StepTimer())
    trainer.train()


def mean_std(xs):
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (float("nan"), 0.0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="a Hugging Face directory (chat model); required")
    p.add_argument("--task", default="rg:chain_sum")
    p.add_argument("--task-args", nargs="*", default=TASK_ARGS)
    p.add_argument("--task-seed", type=int, default=0, help="generates the problems and the split (all seeds)")
    p.add_argument("--task-size", type=int, default=3000)
    p.add_argument("--eval-size", type=int, default=256, help="held-out problems (the split and each evaluation)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--sides", default="hflow,trl", help="any of hflow (GRPO), trl (TRL's GRPO), distill "
                   "(recipes/distill.py towards --teacher)")
    p.add_argument("--teacher", help="the distill side's teacher (a Hugging Face directory)")
    p.add_argument("--samples", type=int, default=4, help="held-out responses shown before/after")
    p.add_argument("--trl-micro-batch", type=int, default=32, help="TRL sequences per forward/backward")
    p.add_argument("--hflow-args", default="", help="extra hflow flags, one string")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep TRL's checkpoints after evaluating them")
    p.add_argument("--out", default="outputs/learn_side_by_side")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trl_worker:
        return trl_worker(a.trl_worker)
    if not a.model_path:
        p.error("--model-path is required")
    if "distill" in a.sides.split(",") and not a.teacher:
        p.error("--sides distill needs --teacher")
    import torch
    torch.set_num_threads(2)
    sides = [s for s in a.sides.split(",") if s]
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = splits(a)
    evaluate = Evaluator(a, held_out)
    start_acc, start_texts, _ = evaluate(a.model_path)
    print(f"{len(train)} training rows, {len(held_out)} held out; starting model: greedy accuracy {start_acc:.4f}",
          flush=True)
    summary = {"args": vars(a), "start_accuracy": start_acc, "seeds": {}}
    for seed in a.seeds:
        summary["seeds"][seed] = results = {}
        for side in sides:
            work = out / f"seed{seed}" / side
            if work.exists():
                shutil.rmtree(work)
            work.parent.mkdir(parents=True, exist_ok=True)
            print(f"seed {seed}: {side} ...", flush=True)
            if side in ("hflow", "distill"):
                r = run_hflow(a, seed, work, "grpo" if side == "hflow" else "distill")
                acc, texts, _ = evaluate(r["final_model"])
                r["check"] = {"hflow_step0": r["curve"].get(0), "evaluator_step0": start_acc,
                              "hflow_final": r["curve"].get(a.steps), "evaluator_final": acc}
            else:
                r = run_trl(a, seed, work, train)
                r["curve"] = {0: start_acc}
                for step, ckpt in r["checkpoints"].items():
                    r["curve"][step], texts, _ = evaluate(ckpt)   # the last one (final model) kept
                    if not a.keep_checkpoints:
                        shutil.rmtree(ckpt)
            r["start"], r["final"] = r["curve"][0], r["curve"][max(r["curve"])]
            r["gain"] = r["final"] - r["start"]
            r["samples"] = [{"prompt": h["prompt"][-1]["content"], "answer": h["answer"], "before": b, "after": t}
                            for h, b, t in zip(held_out[:a.samples], start_texts, texts)]
            results[side] = r
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{'seed':>4} {'side':<6} {'start':>6} {'final':>6} {'gain':>7} {'RL wall s':>9} {'gen s':>6} "
          f"{'upd s':>6} {'tok/s':>6} {'peak GiB':>8}  curve")
    for seed, results in summary["seeds"].items():
        for side, r in results.items():
            ph = r["phase_median_s"]
            print(f"{seed:>4} {side:<6} {r['start']:6.3f} {r['final']:6.3f} {r['gain']:+7.3f} {r['rl_wall_s']:9.1f} "
                  f"{ph['generate']:6.2f} {ph['update']:6.2f} {r['tokens_per_s']:6.1f} {r['peak_gib']:8.2f}  "
                  + " ".join(f"{k}:{v:.3f}" for k, v in sorted(r["curve"].items())))
    for seed, results in summary["seeds"].items():
        for side, r in results.items():
            if "check" in r:
                print(f"evaluator check, seed {seed}: " + ", ".join(f"{k} {v}" for k, v in r["check"].items()))
            if "prompt_ids_match" in r:
                print(f"TRL prompt ids == hflow's rendering, seed {seed}: {r['prompt_ids_match']}")
            for s in r["samples"]:
                print(f"  [{seed} {side}] ...{s['prompt'][-40:]!r} answer {s['answer']}: before {s['before'][:60]!r}"
                      f" -> after {s['after'][:60]!r}")
    walls = {side: [summary["seeds"][s][side]["rl_wall_s"] for s in a.seeds if side in summary["seeds"][s]]
             for side in sides}
    line = []
    for side in sides:
        m, sd = mean_std([summary["seeds"][s][side]["gain"] for s in a.seeds])
        line.append(f"{side} gain {m:+.3f} +- {sd:.3f}")
    if {"hflow", "trl"} <= set(sides) and walls["hflow"] and walls["trl"]:
        ratios = [w1 / w2 for w1, w2 in zip(walls["hflow"], walls["trl"])]
        summary["wall_ratio_hflow_over_trl"] = sum(walls["hflow"]) / sum(walls["trl"])
        line.append(f"wall hflow/trl {summary['wall_ratio_hflow_over_trl']:.2f} "
                    f"(per seed {', '.join(f'{x:.2f}' for x in ratios)})")
    summary["evaluator_seconds"] = evaluate.seconds
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"over {len(a.seeds)} seed(s), (final - start) held-out greedy accuracy: " + "; ".join(line))


if __name__ == "__main__":
    main()
