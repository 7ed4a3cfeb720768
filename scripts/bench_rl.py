"""A whole RL step, side by side: hflow's GRPO recipe vs TRL's `GRPOTrainer` (and hflow's PPO).

Same work on both: the same random Qwen2-shaped model (saved to a temporary Hugging Face
directory with its tokenizer), the same prompts in the same order (no shuffling), GRPO with
B prompts x n samples, temperature 1, fp32, beta = 0 (no reference model), one optimizer step
per batch (one epoch, one mini-batch), one micro-batch per rank (TRL: 64 sequences), the same reward function
and learning rate: 1e-6 on the random models (at the recipes' 1e-4 one Adam step swings a random
model's EOS probability, mean length 52 -> 1 -> 96 in three steps, and the workload with it).

- TRL 1.16: one process, torch.set_num_threads(2), bf16=False, no gradient checkpointing,
  use_vllm=False, per_device_train_batch_size 64 (x gradient accumulation for bigger batches),
  num_iterations 1. Phases are timed by wrapping the trainer's methods: generate = `_generate`;
  old log-probs = `_get_per_token_logps_and_entropies` inside `_generate_and_score_completions`
  (skipped on-policy); update = the rest of the optimizer step (step - generate-and-score);
  whole step = on_step_begin .. on_step_end of a TrainerCallback.
- hflow: the real recipes as a user runs them, `torchrun --nproc-per-node R recipes/grpo.py`
  (R ranks x 2/R threads, OMP_NUM_THREADS), phases read from <output_dir>/metrics.jsonl
  (time/*_s). comm/*: MiB each rank's collectives receive per step, from one more run of 2 steps
  with HFLOW_COUNT_COMM=1 per multi-rank configuration (counting passes every op through
  Python, ~0.1 s a step here, so the timed runs do not count). PPO (`recipes/ppo.py`, its critic, beta 0, no critic
  warm-up) is reported the same way; it has no TRL peer.

Workloads: equal (~25M-parameter Qwen2: hidden 512, 8 layers, vocab 4096; <= 32 new tokens, EOS
made ~impossible so every response is ~32 tokens), vary (the same model with its EOS logit
lifted as scripts/bench_generate.py does, <= 96 new tokens, mean ~50-65), default (the embedded
default model and arithmetic task with the recipes' own defaults; the warmed-up policy when
cached, else the base model: the output says which), short (equal with prompts of 2-6 tokens:
the workload where sharing a prompt among its samples saves least). Prompts of equal/vary: 8-64 random
word tokens, each word one token of a byte-level BPE saved with the model (checked: the text
re-tokenises to the same ids, so TRL and hflow see the same prompt tokens).

Runs alternate (TRL, hflow ..., TRL, hflow ...) for --rounds rounds, each a subprocess of
--steps steps; the first --warmup steps of each run are dropped; figures are medians over
the remaining steps. tokens/s = generated response tokens (EOS included) / wall time.
Compute floor = matmul FLOPs / this script's measured fp32 matmul peak (torch.mm, 2 threads,
the model's shapes, best of a few): generation 2 (N_body + N_head) per generated token +
2 N_body per prompt token; a forward 2 N_body (prompt + response tokens) + 2 N_head per
response token; forward + backward 3x that. Everywhere each prompt counts once: its n samples
can share its tokens (the engine's prefix cache; hflow's packed training passes). Attention score/value products are
not counted (a few % here). Generation's floor is the larger of that and its weight reads: every
fp32 weight once per decode step, as many steps as the longest response, at this script's
measured memory read bandwidth (a sum over 256 MiB). Floors count only the work an on-policy step needs: no old
log-probs for GRPO (both sides skip them); for PPO the critic's values, plus the reference's and
the actor's log-probs when a reference puts a KL in the reward (the default workload).

`--model qwen3-0.6b-moe`: the same as a Qwen3-MoE of the same active size (8 tiny experts of 768,
top 4: the active MLP is the dense 3072; the floors count active weights only).

`--model qwen3-0.6b`: equal/vary on Qwen3-0.6B's shape (hidden 1024, 28 layers, 16/8 heads of 128,
MLP 3072, vocab 151,936, tied) with Qwen3's real tokenizer (tests/fixtures/qwen3), random weights
built once under ~/.cache/hflow/bench/, prompts of 4-16 real word tokens, <= 32 new tokens
(equal) or <= 64 (vary, mean ~28); bf16 on both sides where the CPU has AMX or AVX512-BF16 (else fp32, the
faster there; --bf16 forces it), TRL at 32 sequences a micro-batch to fit 24 GiB. Peak memory
per process is printed beside the phases.

    pip install -e '.[bench]'                                 # TRL; without it: hflow figures only
    python scripts/bench_rl.py --quick                        # a check that it all runs (~2 min)
    python scripts/bench_rl.py --workload vary --rounds 1 --steps 3
    python scripts/bench_rl.py                                # all workloads, 2 rounds (~30 min idle)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

SIZES = {"25m": dict(hidden=512, inter=1376, layers=8, heads=8, kv=4),
         "quick": dict(hidden=128, inter=344, layers=2, heads=4, kv=2),
         # Qwen3-0.6B's shape: 16/8 heads of 128 (wider than hidden / heads), tied embeddings
         "qwen3-0.6b": dict(hidden=1024, inter=3072, layers=28, heads=16, kv=8, head_dim=128, vocab=151936),
         # the same shape as a Qwen3-MoE of tiny experts whose active MLP is the dense one's: 8 experts
         # of 768, top 4 (4 x 768 = 3072 active; twice the dense MLP's weights in all: 0.86B parameters)
         "qwen3-0.6b-moe": dict(hidden=1024, inter=3072, layers=28, heads=16, kv=8, head_dim=128, vocab=151936,
                                experts=8, top_k=4, moe_inter=768)}
# prompts: 8-64 tokens (4-16 at 0.6B); "short" is equal with 2-6-token prompts, where sharing a
# prompt among its n samples saves little and hflow's lead rests on the rest of the step
WORKLOADS = {"equal": dict(max_tokens=32, eos_prob=1e-6, prompt_tokens=(8, 64)),
             "short": dict(max_tokens=32, eos_prob=1e-6, prompt_tokens=(2, 6)),
             "vary": dict(max_tokens=96, eos_prob=0.015, prompt_tokens=(8, 64))}
# at 0.6B: <= 64 new tokens (mean ~28) where lengths vary, so that TRL's one process fits in 24 GiB
QWEN3_WORKLOADS = {"equal": dict(max_tokens=32, eos_prob=1e-6, prompt_tokens=(4, 16)),
                   "short": dict(max_tokens=32, eos_prob=1e-6, prompt_tokens=(2, 6)),
                   "vary": dict(max_tokens=64, eos_prob=0.03, prompt_tokens=(4, 16))}
VOCAB, PAD, EOS = 4096, 0, 1
QWEN3_PAD, QWEN3_EOS = 151643, 151645   # <|endoftext|>, <|im_end|>
QWEN3_FIXTURE = REPO / "tests" / "fixtures" / "qwen3"
REWARD_MODULE = '''"""bench_rl's reward: the fraction of words that start with a lower-case letter."""
def score(response, ground_truth=None, **extra):
    words = response.split()
    return sum(w[0].islower() for w in words) / max(len(words), 1)

def trl_score(completions, **kwargs):
    return [score(c) for c in completions]

def trl_arithmetic(completions, answer, **kwargs):
    from hflow.rewards.arithmetic import arithmetic_score
    return [arithmetic_score(c, a) for c, a in zip(completions, answer)]
'''


# ------------------------------------------------------------ the work: model, tokenizer, prompts

def build_tokenizer():
    """Byte-level BPE of VOCAB tokens under Qwen2's pre-tokenizer (transformers reloads a qwen2
    directory's tokenizer with it): 0 pad, 1 EOS, 256 bytes, then " a".." Zz" and " aaa"...:
    one token per space-led word of 1-3 letters."""
    import itertools
    import string

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hflow.default.model import QWEN2_PRETOKENIZE_REGEX

    vocab = {"<|endoftext|>": PAD, "<|im_end|>": EOS}
    vocab.update({ch: i + 2 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    merges = []
    for word in itertools.chain(*(itertools.product(string.ascii_letters, repeat=k) for k in (1, 2, 3))):
        if len(vocab) == VOCAB:
            break
        merges.append(("Ġ" + "".join(word[:-1]), word[-1]))
        vocab["Ġ" + "".join(word)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|im_end|>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None)


def qwen3_tokenizer(folder: Path):
    """Qwen3's real tokenizer and chat template (tests/fixtures/qwen3), unpacked into `folder`."""
    import gzip

    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(QWEN3_FIXTURE / "tokenizer.json.gz", "rb") as packed, open(folder / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(packed, out)
    shutil.copy(QWEN3_FIXTURE / "tokenizer_config.json", folder)
    return AutoTokenizer.from_pretrained(folder)


def make_model(size: dict, eos_prob: float, seed: int = 0):
    """A random Qwen2 (Qwen3 where the size names a head_dim) whose EOS ends a sequence with
    probability ~eos_prob per token (the trick of scripts/bench_generate.py: hidden dim 0 of
    every embedding is 1, the EOS row gets +delta)."""
    import math

    import torch
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    torch.manual_seed(seed)
    qwen3 = "head_dim" in size
    vocab, eos, pad = (size["vocab"], QWEN3_EOS, QWEN3_PAD) if qwen3 else (VOCAB, EOS, PAD)
    shape = dict(vocab_size=vocab, hidden_size=size["hidden"], intermediate_size=size["inter"],
                 num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                 num_key_value_heads=size["kv"], max_position_embeddings=512, tie_word_embeddings=True,
                 eos_token_id=eos, bos_token_id=pad if qwen3 else eos, pad_token_id=pad)
    if "experts" in size:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **shape, head_dim=size["head_dim"], rope_theta=1e6, rms_norm_eps=1e-6, num_experts=size["experts"],
            num_experts_per_tok=size["top_k"], moe_intermediate_size=size["moe_inter"], norm_topk_prob=True,
            router_aux_loss_coef=0.0))
    elif qwen3:
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=size["head_dim"], rope_theta=1e6, rms_norm_eps=1e-6))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    model.eval()
    emb = model.model.embed_tokens.weight.data
    emb[:, 0] = 1.0
    with torch.no_grad():
        h0 = model.model(torch.randint(2, min(vocab, 4096), (16, 64))).last_hidden_state[..., 0].mean().item()
    emb[eos, 0] = 1.0 + math.log(eos_prob * (vocab - 1) / (1 - eos_prob)) / h0
    return model


def qwen3_model_dir(size: dict, eos_prob: float) -> Path:
    """make_model at a Qwen3 size, saved once in bf16 (1.2 GB at 0.6B) under ~/.cache/hflow/bench/."""
    import torch

    moe = f"-moe{size['experts']}x{size['moe_inter']}top{size['top_k']}" if "experts" in size else ""
    path = Path.home() / ".cache" / "hflow" / "bench" / f"bench_rl-qwen3{moe}-L{size['layers']}-eos{eos_prob:g}"
    if not (path / "config.json").exists():
        make_model(size, eos_prob).to(torch.bfloat16).save_pretrained(path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    return path


def random_prompts(tokenizer, num: int, seed: int = 1, lengths=(8, 64), words: list[int] | None = None) -> list[str]:
    """Texts of `lengths` (inclusive) random word tokens (from `words`, else every word of
    build_tokenizer's vocabulary) that re-tokenise to exactly the drawn ids; a draw that does
    not (two words a real BPE merges) is drawn again."""
    import torch

    g, out = torch.Generator().manual_seed(seed), []
    words = torch.tensor(words) if words is not None else torch.arange(258, VOCAB)
    while len(out) < num:
        count = int(torch.randint(lengths[0], lengths[1] + 1, (), generator=g))
        ids = words[torch.randint(len(words), (count,), generator=g)].tolist()
        text = tokenizer.decode(ids)
        if tokenizer(text, add_special_tokens=False)["input_ids"] == ids:
            out.append(text)
        elif words is None:
            raise AssertionError("a prompt does not re-tokenise to its ids")
    return out


def qwen3_words(tokenizer) -> list[int]:
    """Ids of Qwen3's space-led lower-case English word tokens of 3-8 letters (" the", " house")."""
    import re

    word = re.compile(r"Ġ[a-z]{3,8}")
    return sorted(i for t, i in tokenizer.get_vocab().items() if word.fullmatch(t))


def recipe_config(algo: str):
    """The recipe's own Config() (its defaults), read from recipes/<algo>.py."""
    spec = importlib.util.spec_from_file_location(f"recipe_{algo}", REPO / "recipes" / f"{algo}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Config()


def prepare(name: str, args, root: Path) -> dict:
    """Write the model, tokenizer, prompts and reward module of a workload; return its spec."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    work = root / name
    work.mkdir(parents=True)
    (work / "bench_rl_reward.py").write_text(REWARD_MODULE)
    grpo, ppo = recipe_config("grpo"), recipe_config("ppo")
    spec = dict(name=name, work=str(work), steps=args.steps, lr=grpo.actor.optim.lr, extra=shlex.split(args.hflow_flags))
    actor_bf16 = ["--actor.fsdp.param-dtype", "bfloat16"] if args.bf16 else []
    critic_bf16 = ["--critic.fsdp.param-dtype", "bfloat16"] if args.bf16 else []
    if name == "default":
        from hflow.data import DataConfig, load_prompts
        from hflow.default import default_model_dir, default_policy_dir

        base = default_model_dir(grpo.model.default_size, grpo.model.default_seed)
        warmed = default_policy_dir(grpo.model.default_size, grpo.model.default_seed)
        model_dir = warmed if (warmed / "config.json").exists() else base
        spec["note"] = f"{'warmed-up' if model_dir == warmed else 'un-warmed base'} default policy {model_dir.name}"
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        train = load_prompts(DataConfig(), tokenizer, "train")
        shapes = {a: (c.data.batch_size, c.rollout.n, c.rollout.max_tokens) for a, c in (("grpo", grpo), ("ppo", ppo))}
        count = max(b for b, _, _ in shapes.values()) * args.steps
        rows = [{"prompt": p, "answer": a} for p, a in zip(train.prompts[:count], train.ground_truths[:count])]
        prompt_lens = [len(ids) for ids in train.prompt_ids[:count]]
        spec.update(hflow_flags=actor_bf16, reward="arithmetic", trl_reward="bench_rl_reward:trl_arithmetic",
                    ppo_flags=["--algo.critic-warmup", "0", *critic_bf16], ppo_ref=ppo.algo.kl_coef > 0)
    else:
        qwen3 = args.size.startswith("qwen3")
        workload = (QWEN3_WORKLOADS if qwen3 else WORKLOADS)[name]
        model_dir = work / "model"
        if qwen3:   # the real tokenizer; the model in bf16, built once (a 0.6B build takes a minute)
            size = {**SIZES[args.size], "layers": args.layers or SIZES[args.size]["layers"]}
            shutil.copytree(qwen3_model_dir(size, workload["eos_prob"]), model_dir)
            tokenizer = qwen3_tokenizer(model_dir)
            words = qwen3_words(tokenizer)
        else:
            tokenizer = build_tokenizer()
            make_model(SIZES[args.size], workload["eos_prob"]).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            words = None
        lengths = workload["prompt_tokens"]
        tokenizer = AutoTokenizer.from_pretrained(model_dir)  # as both sides load it
        max_tokens = 16 if args.quick else workload["max_tokens"]
        shapes = {a: (args.batch, args.n, max_tokens) for a in ("grpo", "ppo")}
        rows = [{"prompt": p} for p in random_prompts(tokenizer, args.batch * args.steps, lengths=lengths, words=words)]
        prompt_lens = [len(tokenizer(r["prompt"])["input_ids"]) for r in rows]
        spec.update(note=f"random prompts of {lengths[0]}-{lengths[1]} tokens", reward="bench_rl_reward:score",
                    trl_reward="bench_rl_reward:trl_score", lr=1e-6, hflow_flags=[
                        "--data.train-files", str(work / "prompts.jsonl"), "--data.answer-key", "",
                        "--actor.optim.lr", "1e-6", "--rollout.temperature", "1.0",
                        "--actor.max-tokens-per-micro-batch", "8192", *actor_bf16],   # not grpo's real-model defaults
                    ppo_flags=["--algo.kl-coef", "0", "--algo.critic-warmup", "0", *critic_bf16], ppo_ref=False)
    spec.update(bf16=args.bf16, trl_micro=args.trl_micro_batch)
    with open(work / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    c = AutoConfig.from_pretrained(model_dir)
    h = c.hidden_size
    head_dim = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    # q, o; k, v; gate, up, down (an MoE: the top-k experts' and the router's: the active weights)
    mlp = (3 * h * c.moe_intermediate_size * c.num_experts_per_tok + h * c.num_experts
           if c.model_type == "qwen3_moe" else 3 * h * c.intermediate_size)
    layer = 2 * h * q + 2 * h * kv + mlp
    spec.update(model_dir=str(model_dir), shapes=shapes, prompt_lens=prompt_lens, hidden=h, vocab=c.vocab_size,
                inter=c.intermediate_size, n_body=c.num_hidden_layers * layer, n_head=c.vocab_size * h,
                q=q, kv=kv, layers=c.num_hidden_layers, arch=type(c).__name__.removesuffix("Config"))
    return spec


# ------------------------------------------------------------ runs (each one subprocess)

def run_logged(cmd: list[str], env: dict, log: Path) -> float:
    """Run cmd, output to log; return the children's CPU seconds. Raise with the log's tail."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        raise RuntimeError(f"exit status {rc}: {' '.join(cmd)}\n--- {log} (tail)\n" + log.read_text()[-4000:])
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def run_hflow(spec: dict, algo: str, ranks: int, threads: int, tag: str, count_comm: bool = False,
              steps: int | None = None) -> list[dict]:
    out = Path(spec["work"]) / tag
    batch, n, max_tokens = spec["shapes"][algo]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           f"recipes/{algo}.py", "--model.path", spec["model_dir"], "--reward.fn", spec["reward"],
           *spec["hflow_flags"], "--data.no-shuffle", "--trainer.steps", str(steps or spec["steps"]),
           "--trainer.eval-size", "0", "--trainer.no-export", "--trainer.output-dir", str(out),
           "--rollout.no-progress", "--trainer.logging.no-progress-bars"]
    if spec["name"] != "default":   # the default workload keeps the recipes' own defaults
        # micro-batches: the recipes' 8192-token budget (one packed micro-batch per rank here, as TRL's 64)
        cmd += ["--data.batch-size", str(batch), "--rollout.n", str(n), "--rollout.max-tokens", str(max_tokens)]
    cmd += spec["ppo_flags"] if algo == "ppo" else []
    cmd += spec["extra"]
    pythonpath = os.pathsep.join([spec["work"], str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    start = time.perf_counter()
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": pythonpath}
    if count_comm:   # comm/*: MiB each rank's collectives receive per step; every op then passes through Python
        env["HFLOW_COUNT_COMM"] = "1"
    cpu = run_logged(cmd, env, out.with_suffix(".log"))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    print(f"    {tag}: {time.perf_counter() - start:.0f} s wall, {cpu:.0f} s CPU", flush=True)
    return [r for r in rows if "time/step_s" in r]


def run_trl(spec: dict, threads: int, tag: str) -> list[dict]:
    out = Path(spec["work"]) / tag
    out.mkdir()
    (out / "spec.json").write_text(json.dumps({**spec, "threads": threads, "out": str(out)}))
    start = time.perf_counter()
    cpu = run_logged([sys.executable, __file__, "--trl-worker", str(out / "spec.json")],
                     {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": f"{spec['work']}{os.pathsep}{REPO / 'src'}"},
                     out.with_suffix(".log"))
    print(f"    {tag}: {time.perf_counter() - start:.0f} s wall, {cpu:.0f} s CPU", flush=True)
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def trl_worker(spec_path: str) -> None:
    """Child process: TRL's GRPOTrainer on the spec's work; one metrics row per optimizer step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hflow.distributed.byte_counters import peak_memory_gib

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    batch, n, max_tokens = spec["shapes"]["grpo"]
    rows = [json.loads(line) for line in open(Path(spec["work"]) / "prompts.jsonl")][:batch * spec["steps"]]
    module, _, fn = spec["trl_reward"].partition(":")
    reward = getattr(importlib.import_module(module), fn)
    micro = min(spec["trl_micro"], batch * n)
    args = GRPOConfig(output_dir=spec["out"], per_device_train_batch_size=micro,
                      gradient_accumulation_steps=batch * n // micro, num_generations=n,
                      max_completion_length=max_tokens, temperature=1.0, num_iterations=1, beta=0.0,
                      learning_rate=spec["lr"], lr_scheduler_type="constant", max_steps=spec["steps"],
                      bf16=spec["bf16"], gradient_checkpointing=False, use_vllm=False, shuffle_dataset=False,
                      use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32),
                          reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]))
    acc: dict = {}

    def timed(name, fn, after=None):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            if name != "old" or acc.get("in_gas"):
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - start
            if after:
                after(out)
            return out
        return wrapper

    def count(out):   # _generate's (prompt_ids, completion_ids, ...); completions end with their EOS
        acc["prompt_tokens"] = acc.get("prompt_tokens", 0) + sum(map(len, out[0])) // n
        acc["tokens"] = acc.get("tokens", 0) + sum(map(len, out[1]))
        acc["longest"] = max(acc.get("longest", 0), max(map(len, out[1])))

    generate_and_score = trainer._generate_and_score_completions

    def flagged(*a, **kw):   # old log-probs are the log-prob calls made in here (none on-policy)
        acc["in_gas"] = True
        try:
            return generate_and_score(*a, **kw)
        finally:
            acc["in_gas"] = False

    trainer._generate = timed("generate", trainer._generate, count)
    trainer._get_per_token_logps_and_entropies = timed("old", trainer._get_per_token_logps_and_entropies)
    trainer._generate_and_score_completions = timed("gas", flagged)
    log = open(Path(spec["out"]) / "metrics.jsonl", "w")

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            acc.clear()
            acc["start"] = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            step = time.perf_counter() - acc["start"]
            log.write(json.dumps({
                "step": state.global_step, "time/step_s": step, "time/generate_s": acc["generate"],
                "time/log_probs_s": acc.get("old", 0.0), "time/update_s": step - acc["gas"],
                "response_length/mean": acc["tokens"] / (batch * n), "response_length/max": acc["longest"],
                "prompt_tokens": acc["prompt_tokens"],
                "memory/actor_peak_gib": peak_memory_gib(torch.device("cpu"))}) + "\n")   # as hflow's metric
            log.flush()

    trainer.add_callback(StepTimer())
    trainer.train()


# ------------------------------------------------------------ figures

def compute_dtype(spec: dict):
    import torch

    return torch.bfloat16 if spec["bf16"] else torch.float32


def matmul_peak(spec: dict, threads: int) -> float:
    """Best torch.mm GFLOP/s in the compute dtype over the model's shapes (3 tries each),
    `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    h, i, best, dtype = spec["hidden"], spec["inter"], 0.0, compute_dtype(spec)
    for rows in (256, 1024, 4096):
        for k, m in ((h, i), (i, h), (h, spec["q"]), (h, spec["vocab"])):
            if rows > 256 and 2 * rows * k * m > 2e10:   # a 0.6B head at 4096 rows: seconds a call
                continue
            a, b = torch.randn(rows, k, dtype=dtype), torch.randn(k, m, dtype=dtype)
            torch.mm(a, b)
            reps = max(1, int(1e8 / (2 * rows * k * m)))
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(reps):
                    torch.mm(a, b)
                best = max(best, 2 * rows * k * m * reps / (time.perf_counter() - start) / 1e9)
    return best


def decode_matmul_rates(spec: dict, threads: int, rows=(4, 8, 16, 32, 64)) -> dict[int, float]:
    """GFLOP/s of a decode step's matmuls alone: every layer's q/k/v, o, gate/up and down and the
    LM head on `rows` rows (the step's batch) as the engine runs them (hflow.engine's `linear`,
    on oneDNN-packed weights up to PACK_MAX_ROWS rows), fresh weights of the model's shapes
    (101 MB for the 25M model: they stream from memory, as in decoding), best of 3 passes,
    `threads` threads. Small batches cannot reach the peak: each weight is read for few rows."""
    import torch

    from hflow.engine.model_runner import PACK_MAX_ROWS
    from hflow.engine.models.layers import can_pack, linear, pack

    torch.set_num_threads(threads)
    h, i, q, kv = spec["hidden"], spec["inter"], spec["q"], spec["kv"]
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * spec["layers"] + [(spec["vocab"], h)]
    weights = [torch.randn(n, k, dtype=compute_dtype(spec)) for n, k in shapes]
    packed = [pack(w) if can_pack(w) else None for w in weights]
    rates = {}
    for m in rows:
        xs = {k: torch.randn(m, k, dtype=compute_dtype(spec)) for k in {k for _, k in shapes}}
        flop, best = 2 * m * sum(n * k for n, k in shapes), float("inf")
        for _ in range(4):   # the first pass warms up
            start = time.perf_counter()
            for w, p in zip(weights, packed):
                linear(xs[w.shape[1]], w, packed=p if m <= PACK_MAX_ROWS else None)
            best = min(best, time.perf_counter() - start)
        rates[m] = flop / best / 1e9
    return rates


def memory_bandwidth(threads: int) -> float:
    """Best GB/s of reading a 256 MiB fp32 tensor (a sum), `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    x, best = torch.ones(64 * 2**20), 0.0
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def weight_reads(spec: dict, row: dict) -> float:
    """GB a generation must read at least: every weight (fp32, or bf16 in bf16) once per decode
    step, and there are as many steps as the longest response has tokens (all rows decoded together)."""
    return (2 if spec["bf16"] else 4) * (spec["n_body"] + spec["n_head"]) * row["response_length/max"] / 1e9


def floors(spec: dict, algo: str, row: dict, step: int) -> dict:
    """Matmul GFLOP of the work each phase of one on-policy step needs (see the docstring)."""
    batch, n, _ = spec["shapes"][algo]
    prompt = sum(spec["prompt_lens"][(step - 1) * batch:step * batch])
    resp = row["response_length/mean"] * batch * n
    body, head = spec["n_body"], spec["n_head"]
    # each prompt once: its n samples share its tokens (hflow packs them once, workers/packing.py)
    fwd = 2 * body * (prompt + resp) + 2 * head * resp           # the actor's (or reference's) forward
    value = 2 * body * (prompt + resp) if algo == "ppo" else 0   # the critic's (value head not counted)
    # PPO with a reference puts the KL in the reward: the reference's and the actor's log-probs
    # before the update; GRPO with beta 0 needs no forward before its update
    logp = value + (2 * fwd if algo == "ppo" and spec["ppo_ref"] else 0)
    gen, upd = 2 * (body + head) * resp + 2 * body * prompt, 3 * (fwd + value)
    return {"generate": gen / 1e9, "log_probs": logp / 1e9, "update": upd / 1e9,
            "step": (gen + logp + upd) / 1e9, "prompt_tokens": prompt}


def phase_floor(spec: dict, algo: str, row: dict, phase: str, peak: float, bandwidth: float) -> float:
    """Seconds a phase needs at least: its matmuls at the peak; generation also reads every
    weight once per decode step (a few rows are bound by that, not by the matmuls): the larger."""
    flop = floors(spec, algo, row, row["step"])
    generate = max(flop["generate"] / peak, weight_reads(spec, row) / bandwidth)
    if phase == "generate":
        return generate
    return generate + (flop["log_probs"] + flop["update"]) / peak if phase == "step" else flop[phase] / peak


def report(spec: dict, algo: str, label: str, rows: list[dict], peak: float, bandwidth: float,
           comm: dict[str, float]) -> float:
    """Print the phase table of one configuration (and `comm`, the MiB its ranks' collectives
    receive a step); return its median whole-step tokens/s."""
    batch, n, _ = spec["shapes"][algo]
    tokens = [r["response_length/mean"] * batch * n for r in rows]
    print(f"  {label}: {len(rows)} steps, mean response {statistics.mean(tokens) / (batch * n):.1f} tokens")
    print(f"    {'phase':<14}{'median s':>9}{'tok/s':>9}{'floor s':>9}{'% floor':>9}")
    for phase in ("generate", "log_probs", "update", "step"):
        times = [r[f"time/{phase}_s"] for r in rows]
        floor = statistics.median(phase_floor(spec, algo, r, phase, peak, bandwidth) for r in rows)
        if statistics.median(times) < 0.01 and floor == 0:
            print(f"    {phase:<14}{statistics.median(times):9.3f}   (skipped: on-policy)")
            continue
        rate = statistics.median(t / s for t, s in zip(tokens, times))
        pct = f"{100 * floor / statistics.median(times):8.0f}%" if floor else f"{'-':>9}"
        print(f"    {phase:<14}{statistics.median(times):9.2f}{rate:9.0f}{floor:9.2f}{pct}")
        if floor > statistics.median(times):
            print("    (above 100 %: the matmul peak was measured low; was the machine busy?)")
    other = [r["time/step_s"] - r["time/generate_s"] - r["time/log_probs_s"] - r["time/update_s"] for r in rows]
    print(f"    {'other (score)':<14}{statistics.median(other):9.2f}")
    peaks = [r["memory/actor_peak_gib"] for r in rows if "memory/actor_peak_gib" in r]
    if peaks:   # ru_maxrss: TRL's one process; hflow's largest rank (each holds its share and the engine)
        print(f"    peak memory of the largest process: {max(peaks):.1f} GiB")
    for key, mib in sorted(comm.items()):
        print(f"    {key}: {mib:,.6g} a step (a separate counted run)")
    return step_rate(spec, algo, rows)


def step_rate(spec: dict, algo: str, rows: list[dict]) -> float:
    """Median whole-step tokens/s (response tokens over step wall time) of some steps."""
    batch, n, _ = spec["shapes"][algo]
    return statistics.median(r["response_length/mean"] * batch * n / r["time/step_s"] for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="all", choices=["equal", "short", "vary", "default", "all"])
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (TRL, hflow ...), one subprocess each")
    ap.add_argument("--steps", type=int, default=4, help="RL steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run left out")
    ap.add_argument("--hflow-ranks", default="2,1", help="hflow configurations: ranks (x 2/ranks threads each)")
    ap.add_argument("--no-ppo", dest="ppo", action="store_false", help="skip hflow's PPO runs")
    ap.add_argument("--no-trl", dest="trl", action="store_false", help="skip TRL")
    ap.add_argument("--no-comm", dest="comm", action="store_false",
                    help="skip the extra counted run of each multi-rank configuration (comm/*)")
    ap.add_argument("--batch", type=int, default=16, help="prompts per step (equal/vary)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (equal/vary)")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--model", default="25m", choices=["25m", "qwen3-0.6b", "qwen3-0.6b-moe"],
                    help="equal/vary's model: the 25M Qwen2, Qwen3-0.6B's shape with Qwen3's tokenizer (bf16), or "
                         "that shape as a Qwen3-MoE of the same active size (8 experts of 768, top 4)")
    ap.add_argument("--layers", type=int, default=0, help="qwen3-0.6b with fewer decoder layers (a quick check)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="both sides in bf16 (TRL bf16=True; hflow --actor.fsdp.param-dtype bfloat16, fp32 master "
                         "weights); default: on for qwen3-0.6b on a CPU with AMX or AVX512-BF16, else off (fp32)")
    ap.add_argument("--trl-micro-batch", type=int, default=0,
                    help="TRL's per_device_train_batch_size (default 64; 32 at qwen3-0.6b, to fit 24 GiB)")
    ap.add_argument("--hflow-flags", default="", help="more flags for hflow's recipes, e.g. '--rollout.tp-size 2'")
    ap.add_argument("--quick", action="store_true", help="tiny model, 16 new tokens, equal only, 2 steps, 1 round")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (models, logs, metrics)")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.quick:
        args.workload, args.steps, args.rounds, args.warmup = "equal", 2, 1, 1
    args.size = "quick" if args.quick else args.model
    qwen3 = args.model.startswith("qwen3")
    from hflow.workers.fsdp import cpu_bf16_instructions
    if args.bf16 is None:   # as hflow's auto: bf16 on CPU only where it is fast (hflow.workers.fsdp)
        args.bf16 = qwen3 and cpu_bf16_instructions() is not None
    elif args.bf16 and not cpu_bf16_instructions():
        print("warning: --bf16 on a CPU without bf16 instructions (AMX, AVX512-BF16): bf16 matmuls run far "
              "slower than fp32 here")
    args.trl_micro_batch = args.trl_micro_batch or (32 if qwen3 else 64)
    if args.trl and importlib.util.find_spec("trl") is None:
        print("TRL is not installed: hflow figures only (pip install -e '.[bench]' for the comparison)")
        args.trl = False
    ranks = [int(r) for r in args.hflow_ranks.split(",") if r]
    root = Path(tempfile.mkdtemp(prefix="bench_rl."))
    table = []
    try:
        every = ["equal", "short", "vary"] if qwen3 else ["equal", "short", "vary", "default"]
        for name in (every if args.workload == "all" else [args.workload]):
            spec = prepare(name, args, root)
            peak = matmul_peak(spec, args.cores)    # measured again after the runs; the best is kept
            b, n, t = spec["shapes"]["grpo"]
            print(f"\n== {name}: {spec['arch']} {'bf16' if args.bf16 else 'fp32'}, {(spec['n_body'] + spec['n_head']) / 1e6:.1f}M matmul params (layers "
                  f"{spec['n_body'] / 1e6:.1f}M + lm_head {spec['n_head'] / 1e6:.1f}M), GRPO {b} prompts x {n}, "
                  f"<= {t} new tokens, {spec['note']}; matmul peak {peak:.0f} GFLOP/s ({args.cores} threads)")
            runs = ([("grpo", "trl", 1)] if args.trl else []) + [(a, "hflow", r) for a in ("grpo", "ppo")
                                                                  for r in ranks if a == "grpo" or args.ppo]
            results: dict = {}
            by_round: dict = {}   # (algo, who, r) -> [median step tokens/s of each round]
            for rnd in range(args.rounds):
                for algo, who, r in runs:
                    tag = f"{who}-{algo}-{r}r-round{rnd}"
                    rows = run_trl(spec, args.cores, tag) if who == "trl" else \
                        run_hflow(spec, algo, r, args.cores // r, tag)
                    results.setdefault((algo, who, r), []).extend(rows[args.warmup:])
                    by_round.setdefault((algo, who, r), []).append(step_rate(spec, algo, rows[args.warmup:]))
            # the bytes a rank receives: counting passes every op through Python (~0.1 s a step
            # here), so a separate 2-step run counts them and the timed runs do not
            comm = {(algo, who, r): {k: v for k, v in run_hflow(spec, algo, r, args.cores // r, f"{who}-{algo}-{r}r-comm",
                                                                 count_comm=True, steps=2)[-1].items()
                                     if k.startswith("comm/")}
                    for algo, who, r in runs if who == "hflow" and r > 1 and args.comm}
            peak = max(peak, matmul_peak(spec, args.cores))
            bandwidth = memory_bandwidth(args.cores)
            print(f"  matmul peak, best of before and after the runs: {peak:.0f} GFLOP/s; memory read "
                  f"bandwidth {bandwidth:.1f} GB/s ({args.cores} threads)")
            for threads in sorted({args.cores // r for r in ranks}):
                rates = decode_matmul_rates(spec, threads)
                print(f"  a decode step's matmuls alone, {threads} thread(s), GFLOP/s by rows in the step (% of the "
                      f"peak's {threads}/{args.cores} share): " + ", ".join(
                          f"{m}: {g:.0f} ({100 * g / (peak * threads / args.cores):.0f} %)" for m, g in rates.items()))
            if args.trl:
                trl_prompts = [r["prompt_tokens"] for r in results[("grpo", "trl", 1)]]
                ours = [floors(spec, "grpo", r, r["step"])["prompt_tokens"] for r in results[("grpo", "trl", 1)]]
                print(f"  prompt tokens per step, TRL / hflow's tokenizer: {trl_prompts} / {ours}: "
                      f"{'same' if trl_prompts == ours else 'DIFFERENT'}")
            rates = {}
            for (algo, who, r), rows in results.items():
                label = "TRL GRPOTrainer, 1 process x 2 threads" if who == "trl" else \
                    f"hflow {algo.upper()}, {r} rank{'s' if r > 1 else ''} x {args.cores // r} thread(s)"
                rates[(algo, who, r)] = report(spec, algo, label, rows, peak, bandwidth, comm.get((algo, who, r), {}))
            table += summary_rows(name, rates)
            if args.trl and args.rounds > 1:   # each round's own ratio: how much one round moves
                trl = by_round[("grpo", "trl", 1)]
                for r in ranks:
                    ratios = [ours / theirs for ours, theirs in zip(by_round[("grpo", "hflow", r)], trl)]
                    print(f"  GRPO {r} rank(s) / TRL, round by round: " + ", ".join(f"{x:.2f}x" for x in ratios))
        print("\n| workload | TRL tok/s | hflow 2 ranks tok/s | ratio | hflow 1 rank tok/s | ratio |\n|---|---|---|---|---|---|")
        print("\n".join(table))
    finally:
        if args.keep:
            print(f"work directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def summary_rows(name: str, rates: dict) -> list[str]:
    """docs/performance.md table rows (GRPO against TRL; PPO: hflow only)."""
    out = []
    for algo in ("grpo", "ppo"):
        if not any(k[0] == algo for k in rates):
            continue
        trl = rates.get((algo, "trl", 1))
        cells = [f"{name}" + (" (PPO)" if algo == "ppo" else ""), f"{trl:,.0f}" if trl else "—"]
        for r in (2, 1):
            rate = rates.get((algo, "hflow", r))
            cells += [f"{rate:,.0f}" if rate else "—", f"{rate / trl:.2f}×" if rate and trl else "—"]
        out.append("| " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    main()
