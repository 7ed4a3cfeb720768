"""Build hflow's embedded default model and tokenizer into a directory (no download).

    python scripts/make_default_model.py --out /tmp/hflow-default
    python scripts/make_default_model.py --out /tmp/hflow-25m --size 25m --seed 1

The directory loads with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`
and with `--model.path` in the recipes. The same seed gives byte-identical files.
"""
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from hflow.default.model import SIZES, build_default


@dataclass
class Args:
    out: Path
    """directory to write (created if missing; existing files are overwritten)"""
    size: Literal["tiny", "default", "25m"] = "default"
    """tiny: hidden 64 x 2 layers (tests); default: 256 x 4 (~4M); 25m: 512 x 8 (benchmarks)"""
    seed: int = 0
    """seed of the random weights"""


def main(args: Args):
    path = build_default(args.out, size=args.size, seed=args.seed)
    s = SIZES[args.size]
    print(f"wrote {args.size} model (hidden {s.hidden}, {s.layers} layers, seed {args.seed}) to {path}")


if __name__ == "__main__":
    main(tyro.cli(Args))
