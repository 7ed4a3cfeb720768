"""What every FSDP2 worker shares: micro-batching, the training loop, checkpoints.

The loss of a mini-batch is the same whatever the micro-batching and the number of ranks: the
aggregation `loss_agg` asks for, over the whole mini-batch. The recipe's loss function
aggregates its micro-batch the same way (a mean over its own tokens for token-mean, over its
own sequences for seq-mean-*), and each micro-batch loss L_k is weighted by its share,

    L = sum_k (u_k / U) * L_k,   u_k = tokens (token-mean) or sequences (seq-mean-*) of micro-batch k,
                                 U   = the same count over the mini-batch on all ranks,

which is exactly the mini-batch's token mean (sum of token losses / U) or sequence mean (sum of
sequence losses / U). FSDP averages gradients over the D ranks, so each rank back-propagates
D * (u_k / U) * L_k.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hflow import algos
from hflow.distributed import byte_counters
from hflow.checkpoint import ModelState, export_hf, load_sharded, save_sharded
from hflow.runtime.dispatch import dispatch
from hflow import layout
from hflow.distributed.parallel import device_of, release_freed_memory
from hflow.workers import micro_batches
from hflow.workers.fsdp import FSDPConfig, check_shard_size, free_gathered_params, mixed_precision
from hflow.workers.optim import OptimConfig, all_reduce_sum, apply_optim_config, build_optimizer, clip_grad_norm_


@dataclass
class TrainingConfig:
    """How a trainable model is optimised, sharded and batched (the Actor's and the Critic's)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    epochs: int = 1
    """passes over each batch (PPO epochs)"""
    mini_batch_size: int = 0
    """prompts per optimizer step, each with its rollout.n samples (0: the whole batch)"""
    micro_batch_size: int = 8
    """sequences per forward/backward on one rank"""
    max_tokens_per_micro_batch: int = 0
    """token budget of a micro-batch on one rank, balanced over ranks (0: use micro_batch_size)"""


def as_tensors(batch) -> dict[str, torch.Tensor]:
    """The tensors of a Batch (or of a plain dict)."""
    if isinstance(batch, dict):
        return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    tensors = getattr(batch, "tensors", None)
    if tensors is None:
        tensors = {k: batch[k] for k in batch.keys() if isinstance(batch[k], torch.Tensor)}
    return dict(tensors)


def batch_meta(batch) -> dict:
    return getattr(batch, "meta", None) or {}


def select(tensors: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in tensors.items()}


def stand_in(micro: list[torch.Tensor]) -> torch.Tensor:
    """The rows of the smallest non-empty micro-batch: what an empty micro-batch (a rank with
    fewer rows than the micro-batch count agreed over the ranks) runs in its place, so that
    every rank takes part in each forward's and backward's collectives. A real micro-batch of
    the rank, so that its pass is one the loss function accepts (a reward model's whole pairs);
    its output is dropped, its loss weighted 0."""
    rows = [r for r in micro if len(r)]
    if not rows:
        raise ValueError("a rank has no rows to train or score on")
    return min(rows, key=len)


def num_minibatches(rows: int, n: int, mini_batch_size: int, dp: int, prefix: str) -> int:
    """Mini-batches per epoch for a batch of `rows` sequences (n per prompt) over `dp` ranks.

    Batch sizes are counted in prompts: a mini-batch is `mini_batch_size` prompts, i.e.
    `mini_batch_size * n` sequences, which must split evenly over the ranks.
    """
    if rows % n:
        raise ValueError(f"{rows} sequences are not a whole number of prompts of --rollout.n {n}")
    prompts = rows // n
    mini = min(mini_batch_size or prompts, prompts)   # a batch cut short (DAPO's) is one mini-batch
    if prompts % mini:
        raise ValueError(f"a batch of {prompts} prompts does not split into mini-batches of "
                         f"--{prefix}.mini-batch-size {mini} prompts")
    if (mini * n) % dp:
        raise ValueError(f"--{prefix}.mini-batch-size {mini} x --rollout.n {n} = {mini * n} sequences "
                         f"do not split over {dp} ranks")
    return prompts // mini


def is_on_policy(cfg: TrainingConfig, batch_size: int) -> bool:
    """One epoch of one mini-batch: the policy that sampled is the policy being updated, so its
    log-probs are the update's own (detached) and need no forward pass of their own."""
    return cfg.epochs == 1 and (cfg.mini_batch_size == 0 or cfg.mini_batch_size >= batch_size)


def rollout_log_probs_exact(cfg: TrainingConfig, device_type: str) -> bool:
    """Whether the engine's sampled-token log-probs equal the actor's own: the engine computes in
    the actor's parameter dtype, and in fp32 the two agree to ~1e-6; in bf16 they differ."""
    return mixed_precision(cfg.fsdp, torch.device(device_type)).param_dtype in (None, torch.float32)


def check_batch_sizes(batch_size: int, n: int, mini_batch_size: int, dp: int, prefix: str = "actor") -> None:
    """Fail early (on the controller, before any work) when batch sizes do not divide:
    `batch_size` prompts x `n` samples over `dp` ranks in mini-batches of `mini_batch_size` prompts."""
    if (batch_size * n) % dp:
        raise ValueError(f"--data.batch-size {batch_size} x --rollout.n {n} = {batch_size * n} sequences "
                         f"do not split over {dp} ranks")
    if mini_batch_size > batch_size:
        raise ValueError(f"--{prefix}.mini-batch-size {mini_batch_size} is more than --data.batch-size "
                         f"{batch_size} prompts: lower it (0: the whole batch)")
    num_minibatches(batch_size * n, n, mini_batch_size, dp, prefix)


def trainable_prompts(prompts: int, n: int, mini_batch_size: int, dp: int) -> int:
    """The most prompts, at most `prompts`, whose samples an update can split over `dp` ranks
    and into mini-batches of `mini_batch_size` prompts (0 if none): how much of a batch cut
    short (DAPO's dynamic sampling at its cap) can be trained on."""
    for k in range(prompts, 0, -1):
        if (k * n) % dp == 0 and (k <= (mini_batch_size or k) or k % mini_batch_size == 0):
            return k
    return 0


class ModelWorker:
    """An FSDP2 model on a 1-D data-parallel mesh, with an optional optimizer."""

    flag_prefix: str
    """the flags of the config it is built from, named in its errors (--actor.*: the Reference's too)"""
    metric_prefix: str
    """the prefix of its metrics (actor/loss, critic/grad_norm, ...)"""

    @classmethod
    def check_arguments(cls, ranks: int, cfg=None, *args, **kwargs) -> None:
        """Refuse a config that cannot run on `ranks` ranks, on the controller before any rank
        builds anything (Cluster.spawn calls it): one line, not a traceback from every rank."""
        shard_size = getattr(getattr(cfg, "fsdp", None), "shard_size", 0)
        check_shard_size(shard_size, ranks, f"--{cls.flag_prefix}.fsdp.shard-size", cls.__name__)

    def __init__(self, mesh: DeviceMesh, model: torch.nn.Module, cfg, optim_cfg=None):
        self.mesh, self.model, self.cfg = mesh, model, cfg
        self.device = device_of(mesh)
        self.optimizer = self.scheduler = None
        if optim_cfg is not None:
            self.optimizer, self.scheduler = build_optimizer(model, optim_cfg)
            self.grad_clip = optim_cfg.grad_clip

    # ---- micro-batches -------------------------------------------------------------------

    def micro_batches(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Row indices of this rank's micro-batches; the count is the same on every rank. Under a
        token budget, the rows sharing a prompt go together and the prompt counts once, as the
        packed passes compute it (workers/packing.py)."""
        max_tokens = self.cfg.max_tokens_per_micro_batch
        groups = micro_batches.budget_groups(tensors, max_tokens)
        tokens = micro_batches.packed_tokens(tensors, groups)
        count = micro_batches.micro_batch_count(tokens, self.cfg.micro_batch_size, max_tokens,
                                                row_tokens=tensors["attention_mask"].sum(-1))
        if self.mesh.size() > 1:
            count_t = torch.tensor([count], device=self.device)
            dist.all_reduce(count_t, op=dist.ReduceOp.MAX, group=self.mesh.get_group())
            count = int(count_t)
        return micro_batches.split_micro_batches(tokens, count, balance=max_tokens > 0, groups=groups)

    def to_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}

    @torch.no_grad()
    def forward_rows(self, tensors: dict[str, torch.Tensor], forward: Callable) -> dict[str, torch.Tensor]:
        """Run `forward(micro_batch) -> {key: [b] or [b, r] tensor}` over micro-batches and put
        the rows back in order; per-token outputs are 0 outside `response_mask`."""
        mask = tensors["response_mask"]
        out: dict[str, torch.Tensor] = {}
        micro = self.micro_batches(tensors)
        for rows in micro:
            if not len(rows):   # FSDP's gathers must still run: a stand-in forward, its output dropped
                forward(self.to_device(select(tensors, stand_in(micro))))
                continue
            for key, value in forward(self.to_device(select(tensors, rows))).items():
                value = value.float().cpu()
                if key not in out:
                    out[key] = torch.zeros(len(mask), *mask.shape[1:] if value.ndim == 2 else ())
                if value.ndim == 2:
                    r = value.shape[1]
                    out[key][rows, :r] = value * mask[rows, :r]
                else:
                    out[key][rows] = value
        free_gathered_params(self.model)
        return out

    # ---- training --------------------------------------------------------------------------

    def train(self, tensors: dict[str, torch.Tensor], n: int, loss_of: Callable, epochs: int,
              loss_agg: str = "token-mean") -> dict[str, float]:
        """PPO-style epochs over strided mini-batches, one optimizer step per mini-batch.

        `loss_of(micro_batch) -> (loss, metrics)`, its loss aggregated over the micro-batch as
        `loss_agg` says (see the module docstring). Returns the loss and metrics averaged over
        the optimizer steps (each step's are mini-batch-weighted means over all ranks; a metric
        named *_max is the maximum over everything instead), plus
        grad_norm, lr (the learning rate of the last step), skipped_steps (optimizer steps
        skipped for a non-finite gradient norm), keyed "<role>/<name>" (e.g. actor/loss,
        actor/clipfrac, critic/grad_norm), and memory/<role>_peak_gib: the peak memory so far of
        the largest of its processes (hflow.distributed.byte_counters.peak_memory_gib).
        """
        if loss_agg not in algos.AGG_MODES:
            raise ValueError(f"unknown loss aggregation {loss_agg!r}; choose one of {algos.AGG_MODES}")
        dp = self.mesh.size()
        rows = len(tensors["input_ids"])
        count = num_minibatches(rows * dp, n, self.cfg.mini_batch_size, dp, self.flag_prefix)
        by_tokens = loss_agg == "token-mean"
        self.model.train()
        totals: dict[str, float] = defaultdict(float)
        maxima: dict[str, float] = {}
        steps, skipped, lr = 0, 0, 0.0
        for _ in range(epochs):
            for mini_rows in micro_batches.minibatch_rows(rows, count):
                mini = select(tensors, mini_rows)
                micro = self.micro_batches(mini)
                units = [float(mini["response_mask"][r].sum()) if by_tokens else float(len(r)) for r in micro]
                total = float(all_reduce_sum(torch.tensor([sum(units)]), self.mesh)) or 1.0
                sums: dict[str, float] = defaultdict(float)
                for r, u in zip(micro, units):
                    if not len(r):
                        # every rank runs the same passes (FSDP's collectives): a stand-in pass,
                        # weighted 0, so that it adds exactly nothing to the gradient or the metrics
                        loss, _ = loss_of(layout.trim_padding(self.to_device(select(mini, stand_in(micro)))))
                        (loss * 0.0).backward()
                        continue
                    loss, metrics = loss_of(layout.trim_padding(self.to_device(select(mini, r))))
                    (loss * (dp * u / total)).backward()
                    sums["loss"] += float(loss.detach()) * u / total
                    for key, value in metrics.items():
                        if key.endswith("_max"):   # a maximum stays one: over micro-batches, ranks and steps
                            maxima[key] = max(maxima.get(key, float("-inf")), float(value))
                        elif key != "loss":
                            sums[key] += float(value) * u / total
                grad_norm = clip_grad_norm_(self.model.parameters(), self.grad_clip)
                lr = self.scheduler.get_last_lr()[0]
                # a non-finite norm (the same on every rank) skips the step; the schedule waits
                # too, so that the learning rate follows the steps actually taken
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                    self.scheduler.step()
                else:
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                keys = sorted(sums)
                reduced = all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64), self.mesh)
                for key, value in zip(keys, reduced.tolist()):
                    totals[key] += value
                totals["grad_norm"] += float(grad_norm)
                steps += 1
        metrics = {k: v / steps for k, v in totals.items()}
        # the peak over the ranks too: what a machine must hold for this role's largest process
        maxima["peak_memory_gib"] = byte_counters.peak_memory_gib(self.device)
        keys = sorted(maxima)   # every rank logged the same keys: its loss function's and the peak
        reduced = all_reduce_sum(torch.tensor([maxima[k] for k in keys]), self.mesh, op=dist.ReduceOp.MAX)
        metrics |= dict(zip(keys, reduced.tolist()))
        peak = metrics.pop("peak_memory_gib")
        # on CPU glibc keeps the pages of the step's freed activations and gradients resident, and
        # its heap fragments: untrimmed, each update of the 0.86B MoE (scripts/bench_rl.py) began
        # ~1.5 GiB higher than the last, until the kernel killed the rank in the third
        release_freed_memory(self.device)
        metrics["lr"], metrics["skipped_steps"] = lr, float(skipped)
        metrics = {f"{self.metric_prefix}/{k}": v for k, v in metrics.items()}
        metrics[f"memory/{self.metric_prefix}_peak_gib"] = peak   # beside time/: not the computation's
        if byte_counters.counting_enabled():
            metrics[f"comm/{self.metric_prefix}_received_MiB"] = byte_counters.received_since_last_report() / 2**20
        return metrics

    # ---- checkpoints -----------------------------------------------------------------------

    def _state(self):
        return {"model": ModelState(self.model, self.optimizer, self.scheduler)}

    @dispatch("all")
    def save(self, path: str) -> dict[str, dict]:
        """Sharded checkpoint (torch.distributed.checkpoint) of the model, optimizer and
        schedule in the directory `path`. Collective over the group. Returns the size and sha256
        of the files this rank wrote, for the checkpoint's manifest."""
        return save_sharded(path, self._state(), self.mesh.get_group())

    @dispatch("all")
    def load(self, path: str) -> dict[str, tuple]:
        """Resume from `save(path)`, on any number of ranks. Collective over the group. The
        optimizer then follows this run's flags (a learning rate changed for the resumed run
        takes effect: optim.apply_optim_config); returns what they changed, name -> (the
        checkpoint's value, this run's)."""
        load_sharded(path, self._state(), self.mesh.get_group())
        return apply_optim_config(self.optimizer, self.scheduler, self.cfg.optim) if self.optimizer else {}

    @dispatch("all")
    def export_hf(self, path: str, tokenizer: str | None = None) -> None:
        """Write a Hugging Face directory that `from_pretrained` loads (and the tokenizer of the
        directory `tokenizer`, if given). Collective; the group's first rank writes."""
        export_hf(self.model, path, tokenizer=tokenizer, process_group=self.mesh.get_group())
