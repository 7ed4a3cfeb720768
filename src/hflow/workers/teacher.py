"""The student of on-policy distillation with its frozen teacher beside it (recipes/distill.py).

    student = cluster.spawn(StudentWithTeacher, actor_cfg, teacher_path, "reverse_kl")
    batch = student.generate(prompts, rollout)                  # the student samples
    student.divergence(batch)["divergence"]                     # [B, R] D_t per sampled position
    student.update(batch, functools.partial(algos.distill_loss, ...))

The exact divergence needs the teacher's whole next-token distribution at every position the
student sampled: [tokens, vocabulary] logits, which no transfer between rank groups should carry.
So the teacher is a second sharded model on the student's own ranks (placed like a colocated
reference: frozen, no optimizer state), and each micro-batch runs both models on the same packed
tokens; the divergence is computed from the two logit tensors in place and its gradient flows
into the student's. The cost: the teacher's parameters on the student's ranks and one forward of
it per micro-batch.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from hflow import layout
from hflow.algos.distill import DIVERGENCES
from hflow.batch import Batch
from hflow.faults import fault_point
from hflow.runtime.dispatch import dispatch
from hflow.workers import packing
from hflow.workers.actor import Actor, ActorConfig
from hflow.workers.base import as_tensors, batch_meta, is_on_policy
from hflow.workers.fsdp import free_gathered_params
from hflow.workers.hf_model import build_model
from hflow.workers.micro_batches import packed_row_tokens


class StudentWithTeacher(Actor):
    """The policy (an Actor: it generates, updates, exports) holding a frozen teacher model
    that shares its tokenizer. Its update hands the loss function, beside the student's
    log-probs, each micro-batch's per-token `divergence` [b, r] (with gradient) and the sampled
    tokens' `student_token_log_probs` / `teacher_token_log_probs` (at temperature 1)."""

    def __init__(self, mesh: DeviceMesh, cfg: ActorConfig, teacher_path: str, divergence: str = "reverse_kl",
                 beta: float = 0.5):
        super().__init__(mesh, cfg)
        self.teacher = build_model(teacher_path, mesh, cfg.fsdp, "causal_lm", trainable=False)
        self.teacher.eval()
        student_vocab = self.model.get_output_embeddings().weight.shape[0]
        teacher_vocab = self.teacher.get_output_embeddings().weight.shape[0]
        if student_vocab != teacher_vocab:
            raise ValueError(f"the teacher {teacher_path} has {teacher_vocab} output logits, the student "
                             f"{student_vocab}: distillation compares their distributions token by token, "
                             "so they must share the vocabulary")
        self.divergence_fn, self.beta = DIVERGENCES.find(divergence), beta

    def _signals(self, mb: dict[str, torch.Tensor], temperature: float) -> dict[str, torch.Tensor]:
        """One forward of each model over the micro-batch's packed tokens: the student's
        log-probs of its tokens at `temperature` (its sampling temperature, for a reward's policy
        loss), the divergence at temperature 1 and both models' log-probs of the sampled tokens,
        each [b, R]. The student's carry the gradient when it is enabled."""
        packed = packing.pack(mb)
        inputs = packed.model_inputs()
        with torch.no_grad():
            teacher_logits = self.teacher(**inputs, logits_to_keep=packed.predict_at).logits.squeeze(0)
        student_logits = self.model(**inputs, logits_to_keep=packed.predict_at).logits.squeeze(0)
        targets = packed.targets[:, None]
        student = torch.log_softmax(student_logits.float(), -1)
        teacher = torch.log_softmax(teacher_logits.float(), -1)
        scale = 1.0 if temperature in (0, 1) else 1.0 / temperature
        at_temperature = student if scale == 1.0 else torch.log_softmax(student_logits.float() * scale, -1)
        return {"log_probs": packed.unpack(at_temperature.gather(-1, targets).squeeze(-1)),
                "divergence": packed.unpack(self.divergence_fn(student, teacher, self.beta)),
                "student_token_log_probs": packed.unpack(student.detach().gather(-1, targets).squeeze(-1)),
                "teacher_token_log_probs": packed.unpack(teacher.gather(-1, targets).squeeze(-1))}

    @dispatch("dp", balance=packed_row_tokens)
    @torch.no_grad()
    def divergence(self, batch) -> Batch:
        """{divergence, student_token_log_probs, teacher_token_log_probs}: [B, R] each, 0
        outside response_mask (the student's held-out distance to the teacher)."""
        self.model.eval()

        def forward(mb):
            signals = self._signals(layout.trim_padding(mb), 1.0)
            del signals["log_probs"]
            return signals

        out = self.forward_rows(as_tensors(batch), forward)
        free_gathered_params(self.teacher)
        return Batch(out)

    @dispatch("dp", balance=packed_row_tokens)
    def update(self, batch, loss_fn: Callable, temperature: float | None = None, with_entropy: bool = False,
               loss_agg: str = "token-mean") -> dict[str, float]:
        """Train the student on a batch of its own samples: `loss_fn(log_probs, micro_batch)`
        with the micro-batch's signals added (see the class). On-policy only when the loss
        reads old log-probs (a task reward's policy loss): they are the current ones, detached."""
        if with_entropy:
            raise ValueError("StudentWithTeacher.update computes no entropy")
        self._refuse_while_rollout_open("actor.update")
        meta = batch_meta(batch)
        temperature = temperature if temperature is not None else meta.get("temperature", 1.0)
        tensors, n = as_tensors(batch), int(meta.get("n", 1))
        if "advantages" in tensors and not is_on_policy(self.cfg, len(tensors["input_ids"]) * self.mesh.size() // n):
            raise ValueError("a task reward's policy loss here is on-policy only: --actor.epochs 1, one mini-batch")

        def loss_of(mb):
            signals = self._signals(mb, temperature)
            log_probs = signals.pop("log_probs")
            return loss_fn(log_probs, self.wrap({**mb, **signals}, batch))

        fault_point("update")
        metrics = self.train(tensors, n, loss_of, self.cfg.epochs, loss_agg)
        free_gathered_params(self.teacher)
        return metrics
