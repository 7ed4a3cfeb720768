"""Any step's checkpoint as a Hugging Face directory (verl's model_merger): the actor's weights
out of the sharded checkpoint, verified against its manifest, into the base model's class.

    python -m hflow.checkpoint.to_hf outputs/grpo/checkpoints/step_100 --model BASE --out step100_hf
    python -m hflow.checkpoint.to_hf .../step_100 --model BASE --out step100_hf --lora-alpha 32   # a LoRA run

BASE is the run's starting policy (its --model.path; for the embedded default the warmed-up
policy the run printed): its config, tokenizer and, under LoRA, the frozen base weights. A LoRA
checkpoint holds only the adapters: they are merged into BASE's weights (OUT) and written as a
PEFT adapter directory too (OUT_lora), with --lora-alpha the run's --actor.lora.alpha.
Runs on one process, on CPU; no process group.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hflow import lora
from hflow.checkpoint.errors import CheckpointError
from hflow.checkpoint.export import write_peft_adapter, written_in_place
from hflow.checkpoint.integrity import verify
from hflow.checkpoint.safe_format import read_dcp_metadata
from hflow.checkpoint.sharded import load_sharded

# where ModelState keeps the weights in a DCP checkpoint: {"model": {"model": state_dict, "optimizer": ...}}
WEIGHTS = "model.model."


def checkpoint_to_hf(step_dir, model_dir, out, role: str = "actor", lora_alpha: float | None = None) -> Path:
    """Write the `role` weights of the checkpoint `step_dir` (a checkpoints/step_N directory) as
    a Hugging Face directory `out` of `model_dir`'s class and tokenizer; returns `out`."""
    step_dir, out = Path(step_dir), Path(out)
    path = step_dir / role
    if not step_dir.is_dir():
        steps = sorted(p.name for p in step_dir.parent.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        raise FileNotFoundError(f"{step_dir}: no such checkpoint (beside it: {', '.join(steps) or 'none'})")
    if not (path / ".metadata").exists():
        roles = sorted(p.parent.name for p in step_dir.glob("*/.metadata"))
        raise FileNotFoundError(f"{step_dir}: no {role!r} checkpoint in it (roles: {', '.join(roles) or 'none'})")
    problems = verify(step_dir)
    if problems:
        raise CheckpointError(f"{step_dir} does not match its manifest: " + "; ".join(problems))
    shapes = {k[len(WEIGHTS):]: tuple(v.size) for k, v in read_dcp_metadata(path).state_dict_metadata.items()
              if k.startswith(WEIGHTS)}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = model.state_dict()
    wrong = [f"{n} {shapes[n]} vs {tuple(state[n].shape)}" for n in shapes if n in state and shapes[n] != tuple(state[n].shape)]
    if wrong:
        raise ValueError(f"{step_dir} is not a checkpoint of {model_dir}: shapes differ ({'; '.join(wrong[:3])})")
    adapters = {n: torch.empty(s) for n, s in shapes.items() if lora.is_adapter(n)}
    unknown = [n for n in shapes if n not in state and n not in adapters]
    if unknown:
        raise ValueError(f"{step_dir} is not a checkpoint of {model_dir}: it has {unknown[:3]}, the model has not")
    if adapters and lora_alpha is None:
        rank = next(iter(adapters.values())).shape[0]
        raise ValueError(f"{step_dir} holds LoRA adapters (rank {rank}): give --lora-alpha, the run's "
                         f"--actor.lora.alpha (its default is {lora.LoRAConfig().alpha:g})")
    template = {n: state.get(n, adapters.get(n)) for n in shapes}   # filled in place
    load_sharded(path, {"model": {"model": template}})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if adapters:
        cfg = lora.LoRAConfig(rank=next(iter(adapters.values())).shape[0], alpha=lora_alpha,
                              targets=tuple(sorted({n.rsplit(".", 2)[-2] for n in adapters})))
        full = {**state, **adapters}
        model.load_state_dict(lora.merge_state_dict(full, cfg.scaling))
        with written_in_place(out.with_name(out.name + "_lora")) as partial:
            write_peft_adapter(partial, full, cfg, str(model_dir))
    with written_in_place(out) as partial:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hflow.checkpoint.to_hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoints/step_N directory")
    ap.add_argument("--model", required=True, help="the run's starting policy (its --model.path)")
    ap.add_argument("--out", required=True, help="the Hugging Face directory to write")
    ap.add_argument("--role", default="actor", help="which trained model of the checkpoint (a causal LM)")
    ap.add_argument("--lora-alpha", type=float, help="a LoRA run's --actor.lora.alpha")
    args = ap.parse_args(argv)
    try:
        out = checkpoint_to_hf(args.checkpoint, args.model, args.out, args.role, args.lora_alpha)
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        raise SystemExit(f"hflow.checkpoint.to_hf: {e}")
    print(f"wrote {out}" + (f" and {out}_lora" if Path(f"{out}_lora").exists() else ""))


if __name__ == "__main__":
    main()
