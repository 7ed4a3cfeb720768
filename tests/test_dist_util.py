import pytest

from dist import torchrun


@pytest.mark.dist
def test_torchrun_runs_every_rank(tmp_path):
    run = torchrun("""
        import os
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print(f"rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
        dist.destroy_process_group()
    """, nproc=2, tmp_path=tmp_path, timeout=120).check()
    assert "rank 0 of 2" in run.output and "rank 1 of 2" in run.output


@pytest.mark.dist
def test_torchrun_timeout_kills_a_hang(tmp_path):
    run = torchrun("import time\ntime.sleep(600)\n", nproc=1, tmp_path=tmp_path, timeout=10)
    assert run.timed_out
