"""The soak test: hours of RPC stress and repeated default runs, looking for the heap corruption
seen once (`malloc(): unaligned tcache chunk detected` on rank 0 at step 142 of a default run).

    python scripts/soak.py --hours 2                      # alternate the two until the time is up
    python scripts/soak.py --hours 8 --no-debug-malloc    # glibc's own allocator (faster)

Each round runs in a fresh directory under --out with core dumps enabled (RLIMIT_CORE unlimited;
where they land is the kernel's core_pattern, printed at start) and, unless --no-debug-malloc,
glibc's debugging allocator (LD_PRELOAD=libc_malloc_debug.so.0, MALLOC_CHECK_=3: on glibc >= 2.34
MALLOC_CHECK_ alone does nothing). Rounds alternate between:

  rpc   scripts/soak_rpc.py: calls in flight on overlapping groups, random Batch sizes, the
        heartbeat every 50 ms, results checked (--rpc-seconds each);
  run   a default recipe (--recipe, 2 ranks, the embedded default's cached warm-up) for --steps.

A round fails on a non-zero exit, a line mentioning malloc/free/corrupted/double free/segfault in
its output, or a core file. Every round is one JSON line in --out/soak.jsonl; the last line says
how many rounds ran and failed. Exits 1 if any failed.
"""
from __future__ import annotations

import glob
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

REPO = Path(__file__).resolve().parents[1]
HEAP_TROUBLE = re.compile(r"malloc|free\(\)|corrupted|double free|Segmentation fault|SIGSEGV|SIGABRT|core dumped",
                          re.IGNORECASE)
DEBUG_MALLOC = ("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", "/usr/lib/aarch64-linux-gnu/libc_malloc_debug.so.0",
                "/lib64/libc_malloc_debug.so.0")


@dataclass
class Config:
    hours: float = 1.0
    """How long to keep starting rounds."""
    out: str = "outputs/soak"
    """Where each round's directory and soak.jsonl go."""
    recipe: str = "grpo"
    """The default recipe a run round trains (recipes/<recipe>.py)."""
    steps: int = 150
    """RL steps of a run round (150: the default run, which met the corruption at step 142)."""
    rpc_seconds: float = 300.0
    """Length of an rpc round."""
    ranks: int = 2
    debug_malloc: bool = True
    """glibc's debugging allocator (slower; checks every free)."""


def environment(cfg: Config) -> dict:
    env = {**os.environ, "HFLOW_HEARTBEAT_S": "0.05", "PYTHONPATH": str(REPO / "src")}
    if cfg.debug_malloc:
        library = next((path for path in DEBUG_MALLOC if os.path.exists(path)), None)
        if library is None:
            print("soak: no libc_malloc_debug.so.0 found: glibc's own allocator", flush=True)
        else:
            env |= {"LD_PRELOAD": library, "MALLOC_CHECK_": "3"}
    return env


def with_core_dumps():
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_round(kind: str, number: int, cfg: Config, env: dict) -> dict:
    where = Path(cfg.out) / f"{number:04d}-{kind}"
    where.mkdir(parents=True, exist_ok=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.ranks)]
    if kind == "rpc":
        command = torchrun + [str(REPO / "scripts" / "soak_rpc.py"), "--seconds", str(cfg.rpc_seconds),
                              "--seed", str(number)]
        limit = cfg.rpc_seconds + 300
    else:
        command = torchrun + [str(REPO / "recipes" / f"{cfg.recipe}.py"), "--trainer.steps", str(cfg.steps),
                              "--trainer.output-dir", str(where / "run"), "--trainer.logging.no-progress-bars",
                              "--data.seed", str(number), "--rollout.seed", str(number)]
        limit = 3600
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, timeout=limit,
                              preexec_fn=with_core_dumps)
        code, stdout, output = done.returncode, done.stdout, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")   # noqa: E731
        code, stdout = "timeout", text(e.stdout)
        output = stdout + text(e.stderr)
    (where / "output.txt").write_text(output)
    trouble = sorted({m.group(0) for m in HEAP_TROUBLE.finditer(output)})
    cores = glob.glob(str(where / "core*"))
    return {"round": number, "kind": kind, "seconds": round(time.monotonic() - start, 1), "exit": code,
            "heap_trouble": trouble, "cores": cores, "failed": code != 0 or bool(trouble) or bool(cores),
            "last_line": stdout.strip().splitlines()[-1][:200] if stdout.strip() else ""}


def main(cfg: Config) -> int:
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    env = environment(cfg)
    pattern = Path("/proc/sys/kernel/core_pattern")
    print(f"soak: {cfg.hours} h of rpc and {cfg.recipe} rounds; core_pattern "
          f"{pattern.read_text().strip() if pattern.exists() else '?'}; allocator "
          f"{env.get('LD_PRELOAD', 'glibc')}", flush=True)
    log, deadline, number, failed = Path(cfg.out) / "soak.jsonl", time.monotonic() + cfg.hours * 3600, 0, 0
    while time.monotonic() < deadline:
        kind = "run" if number % 2 == 0 else "rpc"
        record = run_round(kind, number, cfg, env)
        failed += record["failed"]
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"soak: round {number} {kind}: {'FAILED' if record['failed'] else 'ok'} in {record['seconds']} s "
              f"({record['last_line'][:100]})", flush=True)
        number += 1
    summary = {"rounds": number, "failed": failed, "hours": cfg.hours}
    with log.open("a") as f:
        f.write(json.dumps(summary) + "\n")
    print(f"soak: {number} rounds, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Config)))
