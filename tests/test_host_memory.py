"""The low-water mark of the host's available memory, read from real files laid out as
/proc/meminfo and a cgroup v2 directory are: what a rank says when a peer vanishes."""
from hflow.runtime.host_memory import LowWater, read_meminfo

GIB = 2 ** 30


def meminfo(path, available_gib: float, total_gib: float = 24.0):
    path.write_text(f"MemTotal:       {int(total_gib * 2**20)} kB\nMemFree:        1 kB\n"
                    f"MemAvailable:   {int(available_gib * 2**20)} kB\n")


def test_reads_proc_meminfo_of_this_machine():
    available, total = read_meminfo()
    assert 0 < available <= total


def test_a_cgroup_limit_below_the_host_is_what_counts(tmp_path):
    meminfo(tmp_path / "meminfo", available_gib=20)
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{8 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{7 * GIB}\n")
    assert read_meminfo(str(tmp_path / "meminfo"), str(cgroup)) == (1 * GIB, 8 * GIB)
    (cgroup / "memory.max").write_text("max\n")   # no limit: the host's figures
    assert read_meminfo(str(tmp_path / "meminfo"), str(cgroup)) == (20 * GIB, 24 * GIB)
    assert read_meminfo(str(tmp_path / "absent"), str(cgroup)) is None


def test_a_dip_within_the_window_explains_a_vanished_rank(tmp_path):
    path = tmp_path / "meminfo"
    water = LowWater(window_s=30, path=str(path), cgroup=str(tmp_path / "none"))
    meminfo(path, available_gib=10)
    water.sample(now=0.0)
    assert water.explain("rank 0") == ""
    meminfo(path, available_gib=0.3)   # below 5 % of 24 GiB
    water.sample(now=10.0)
    meminfo(path, available_gib=15)    # the killed process's memory is back
    water.sample(now=20.0)
    said = water.explain("rank 0")
    assert "fell to 0.3 GiB of 24.0" in said and "rank 0 was most likely ended" in said
    assert "--actor.fsdp.activation-checkpointing" in said
    water.sample(now=45.0)             # the dip has left the 30 s window
    assert water.lowest() == 15 * GIB and water.explain("rank 0") == ""


def test_no_meminfo_says_nothing(tmp_path):
    water = LowWater(path=str(tmp_path / "absent"))
    water.sample()
    assert water.lowest() is None and water.explain("rank 1") == ""
