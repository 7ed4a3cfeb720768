"""The bookkeeping of a run around a recipe's loop: the step counter and resume, the metrics
logger, the evaluation and checkpoint cadence, the final export. Never the algorithm.

    run = Run(cfg.trainer, trained={"actor": actor, "critic": critic},
              state={"data": sampler, "kl_ctrl": kl_ctrl}, evaluate=evaluate_now,
              export=(actor, model_dir))
    for step in run.steps():          # resumes after the latest checkpoint with --trainer.resume
        metrics = ...                 # the algorithm
        run.end_step(step, metrics)   # evaluates, logs and checkpoints on their cadence
    run.finish()                      # exports the final policy, closes the logger

A Ctrl-C or SIGTERM (hflow.runtime.stopping) ends the run after the step in progress, with that step
checkpointed whatever --trainer.save-every says, so that --trainer.resume continues it.

`trained` are the worker groups whose models, optimizers and schedules each checkpoint holds;
`state` holds controller objects with state_dict/load_state_dict (the data sampler, a KL
controller), saved with every checkpoint and restored on resume together with the RNG.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from hflow import checkpoint
from hflow.runtime import stopping
from hflow.metrics import MetricsLogger
from hflow.validation import UserError


class RunStopped(UserError):
    """The run cannot usefully go on (e.g. too many skipped optimizer steps)."""


CONFIG_FILE = "config.json"


def write_run_config(output_dir: Path, run_config: dict) -> None:
    """`output_dir`/config.json: every flag of the run as it resolved (written whole, then renamed)."""
    tmp = output_dir / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(run_config, indent=1, default=str) + "\n")
    os.replace(tmp, output_dir / CONFIG_FILE)


class Run:
    def __init__(self, trainer, trained: dict, state: dict | None = None,
                 evaluate: Callable[[], dict] | None = None, export: tuple | None = None, about: str = "",
                 samples: Callable[[], list[dict]] | None = None, eval_prompts: int | None = None,
                 run_config: dict | None = None):
        self.cfg, self.trained, self.state = trainer, trained, state or {}
        # how many held-out prompts an evaluation covers: the split's size where it is smaller than
        # --trainer.eval-size, 0 where there is none (then nothing is evaluated)
        self.eval_prompts = trainer.eval_size if eval_prompts is None else min(eval_prompts, trainer.eval_size)
        self.evaluate = evaluate if self.eval_prompts > 0 else None
        self.export, self.samples = export, samples
        self.evaluations: list[dict] = []   # every evaluation's metrics, for the final line
        self.began = time.monotonic()
        self.root = Path(trainer.output_dir) / checkpoint.dirs.CHECKPOINTS
        self.start_step, resumed = 0, False
        if trainer.resume and (extra := checkpoint.resume_run(self.root, trained)):
            resumed = True
            self.start_step = extra["step"]
            for name, obj in self.state.items():
                obj.load_state_dict(extra[name])
            changed = "".join(f"; {role}'s {name} {old} -> {new}" for role, settings in extra["changed_settings"].items()
                              for name, (old, new) in settings.items())
            print(f"hflow: resumed from step {self.start_step} ({self.root / f'step_{self.start_step}'})"
                  + (f" (this run's flags replace the checkpoint's{changed})" if changed else ""), flush=True)
        self.skipped, self.saved_step = 0, self.start_step
        self.logger = MetricsLogger(trainer.output_dir, trainer.logging, trainer.steps,
                                    resume_step=self.start_step if resumed else None, run_config=run_config)
        if run_config is not None:   # the flags this run resolved to, defaults included (a resumed run's own)
            write_run_config(Path(trainer.output_dir), run_config)
        print(self.header(about), flush=True)

    def header(self, about: str = "") -> str:
        """What the run is about to do, in one line: steps, the evaluation and checkpoint
        cadence, where its output goes (and `about`: the recipe's data and placement)."""
        cfg = self.cfg
        if self.start_step >= cfg.steps:
            todo = f"already at step {self.start_step} of {cfg.steps}: nothing to do (raise --trainer.steps to go on)"
        else:
            todo = f"steps {self.start_step + 1}..{cfg.steps}"
        evaluation = ("no held-out evaluation" if not self.evaluate else
                      f"held-out evaluation on {self.eval_prompts} prompts " +
                      (f"every {cfg.eval_every} steps and at the end" if cfg.eval_every else "at the start and the end"))
        saves = f"a checkpoint every {cfg.save_every} steps" if cfg.save_every else "no checkpoints (--trainer.save-every)"
        return (f"hflow: {todo}; {evaluation}; {saves}; output in {cfg.output_dir}" + (f"; {about}" if about else ""))

    def steps(self) -> Iterator[int]:
        """1 .. --trainer.steps, after the resumed step; a fresh run first logs step 0's evaluation."""
        self._stop_if_asked(None)
        if self.start_step == 0 and self.evaluate:
            self.logger.log(0, self._evaluate())
        for step in range(self.start_step + 1, self.cfg.steps + 1):
            self._stop_if_asked(step - 1)
            yield step
        self._stop_if_asked(self.cfg.steps)   # asked during the last step: it is saved all the same

    def end_step(self, step: int, metrics: dict) -> None:
        """Evaluate every --trainer.eval-every steps and at the last, log, checkpoint every
        --trainer.save-every steps."""
        if self.evaluate and (self.cfg.eval_every and step % self.cfg.eval_every == 0 or step == self.cfg.steps):
            metrics |= self._evaluate()
        self.logger.log(step, metrics)
        every = self.cfg.logging.samples_every
        if self.samples and every and (step == self.start_step + 1 or step % every == 0):
            self._show_samples(step, self.samples())
        self.skipped += int(sum(v for k, v in metrics.items() if k.endswith("/skipped_steps")))
        if self.skipped > self.cfg.max_skipped_steps:
            self.logger.close()
            raise RunStopped(f"{self.skipped} optimizer steps skipped so far (non-finite loss or gradient "
                             f"norm; see <role>/skipped_steps), more than --trainer.max-skipped-steps "
                             f"{self.cfg.max_skipped_steps}: lower the learning rate, look for inf/NaN in "
                             f"the rewards or data, or raise the limit")
        if self.cfg.save_every and step % self.cfg.save_every == 0:
            self._save(step)

    def _show_samples(self, step: int, rows: list[dict]) -> None:
        """A few of the step's (prompt, response, score) on the console and in samples.jsonl:
        a prompt in a format the model does not know shows at the first step."""
        if not rows:
            return
        clip = lambda text: text if len(text) <= 120 else text[:117] + "..."   # noqa: E731
        print(f"hflow: step {step} samples (prompt -> response: score):\n" + "\n".join(
            f"  {clip(r['prompt'])!r} -> {clip(r['response'])!r}: {r['score']:.3g}" for r in rows), flush=True)
        with open(Path(self.cfg.output_dir) / "samples.jsonl", "a") as f:
            f.writelines(json.dumps({"step": step, **r}) + "\n" for r in rows)

    def _evaluate(self) -> dict:
        metrics = self.evaluate()
        if metrics:
            self.evaluations.append(metrics)
        return metrics

    def _save(self, step: int) -> None:
        extra = {name: obj.state_dict() for name, obj in self.state.items()}
        checkpoint.save_run(self.root, step, self.trained, extra, self.cfg.keep_last)
        self.saved_step = step

    def _stop_if_asked(self, completed: int | None) -> None:
        """After a Ctrl-C / SIGTERM: checkpoint the last completed step and end the run."""
        signum = stopping.requested()
        if signum is None:
            return
        name = stopping.signal_name(signum)
        if completed is None or completed == self.start_step:
            latest = checkpoint.latest_checkpoint(self.root)
            kept = f"the last checkpoint is {latest}" if latest else "no checkpoint was made"
            what = f"before step {self.start_step + 1} ({kept})"
        else:
            if self.saved_step != completed:
                self._save(completed)
            what = f"after step {completed} of {self.cfg.steps}, saved in {checkpoint.checkpoint_dir(self.root, completed)}"
        self.logger.close()
        again = "" if self.cfg.resume else " and --trainer.resume"
        raise stopping.RunInterrupted(f"hflow: stopped by {name} {what}; continue with the same command{again}",
                                      signum)

    def finish(self) -> None:
        """Export the policy (`export` = (worker group, tokenizer directory)) to output_dir/actor_hf."""
        exported = ""
        if self.cfg.export and self.export:
            group, tokenizer_dir = self.export
            group.export_hf(f"{self.cfg.output_dir}/actor_hf", tokenizer_dir)
            exported = f"; exported to {self.cfg.output_dir}/actor_hf"
        self.logger.close()
        print(f"hflow: done: step {self.cfg.steps} of {self.cfg.steps} in {time.monotonic() - self.began:.0f} s"
              f"{self._evaluated()}{exported}; metrics in {self.cfg.output_dir}/metrics.jsonl", flush=True)

    def _evaluated(self) -> str:
        """`; held-out <key> first -> last` for the evaluation's first metric (the recipe's headline)."""
        if not self.evaluations:
            return ""
        key = next(iter(self.evaluations[-1]))
        values = [e[key] for e in self.evaluations if key in e]
        trend = " -> ".join(f"{v:.3f}" for v in (values[0], values[-1])) if len(values) > 1 else f"{values[-1]:.3f}"
        return f"; held-out {key} {trend} (this run's evaluations)"
