"""The embedded default's warm-up (tiny size) into CACHE_DIR; run by test_stopping.py, once with
HFLOW_FAULT=update:0:int:N (a Ctrl-C at the N-th step) and then again to continue it."""
import sys

import hflow
from hflow.default.warm_up import default_policy


def main(cluster, cfg):
    cache_dir, max_steps = sys.argv[1], int(sys.argv[2])
    # stop_at 0 ends the warm-up at its first check: step 25, or max_steps if fewer
    path = default_policy(cluster, "tiny", 0, stop_at=0.0, max_steps=max_steps, cache_dir=cache_dir)
    print(f"warm-up done: {path}", flush=True)


if __name__ == "__main__":
    hflow.launch(main)
