"""A worker raises (argv: raise RANK), or a rank is SIGKILLed (argv: kill RANK) or frozen with SIGSTOP (argv: stop RANK) mid-call; run by test_failure.py's tests."""
import os, signal, sys, time
import torch, torch.distributed as dist
import hflow
from hflow.runtime.dispatch import dispatch


class Worker:
    def __init__(self, mesh):
        self.mesh = mesh

    @dispatch("all")
    def pid(self):
        return os.getpid()

    @dispatch("all")
    def fail_on(self, bad_rank):
        if dist.get_rank() == bad_rank:
            raise ValueError("bad input on purpose")
        t = torch.ones(1)
        dist.all_reduce(t, group=self.mesh.get_group())   # the others wait here, forever
        return t.item()

    @dispatch("all")
    def spin(self):
        while True:                                        # a long call full of collectives
            dist.all_reduce(torch.ones(1), group=self.mesh.get_group())
            time.sleep(0.01)


def main(cluster, cfg):
    mode, victim = sys.argv[1], int(sys.argv[2])
    group = cluster.spawn(Worker)
    pids = group.pid()
    if mode == "raise":
        print(f"T_FAIL {time.time()}", flush=True)
        try:
            group.fail_on(victim)
        except hflow.RemoteError as e:
            assert e.rank == victim and "bad input on purpose" in e.remote_traceback
            print(f"CAUGHT {e}", flush=True)
        try:                      # the run is failed now: later calls refuse at once
            group.pid()
        except hflow.RemoteError as e:
            print(f"REFUSED rank {e.rank}", flush=True)
        return "returned normally"                 # ...and the exit is non-zero anyway
    pending = group.spin.future()
    time.sleep(0.5)
    print(f"T_FAIL {time.time()}", flush=True)
    os.kill(pids[victim], signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    pending.result()


if __name__ == "__main__":
    print(hflow.launch(main), flush=True)
