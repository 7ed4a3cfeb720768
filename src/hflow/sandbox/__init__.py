"""The code sandbox: an untrusted Python program run in a fresh interpreter the kernel isolates,
then checked against tests where the program cannot reach them.

Used by the code reward (``hflow.rewards.code``, ``--reward.fn code``: a generated solution
against a row's asserts) and by the agents' ``python`` tool (``hflow.agents.builtin_tools``: a
program with no tests, whose output comes back). ``run_tests(source, tests, limits)`` runs
``source``, then checks each test (a Python statement, typically ``assert f(2) == 4``), and
returns a ``RunResult``: per test whether it passed, the program's error if the tests did not all
run, whether a time limit stopped it, the layers that were in place.

Tests. A test is checked outside the solution's process (``probes``): it is split into *probes*,
the parts that call into the solution (``f(2)`` in ``assert f(2) == 4``, arguments included),
which the sandboxed program evaluates after the solution and sends back as plain data (None,
bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, range; an iterator as
its items; anything else fails the test), and the rest (the comparison, ``abs(x - 1.5) < 1e-9``,
``set(x) == {1, 2}``, ``math.isclose(...)``), which this process evaluates on those values with a
small interpreter of Python's syntax tree (``checker``). A test that cannot be split so (a loop, a
``def``, a call into the solution on a value the test computed, a construct the interpreter
lacks) is not run and fails (``RunResult.untrusted``). Unlike in the solution's namespace, the
tests' built-ins and ``math``/``cmath`` always mean those (no import needed, no shadowing), and
probes are evaluated in order even where the test short-circuits (a failed one counts only if its
value is used).

Trust. The parent trusts nothing the solution's process can write. The expected values never
enter that process (it gets only the probes; unless a test hands one to the solution's code, as
in ``check(f(x), expected)``), and what comes back is decoded as values, so no ``__eq__``,
``__bool__`` or verdict of the solution's is ever used. A solution that took over
its whole process can still only choose the values of its probes without knowing what they are
compared with, which is what answering them does. The sandbox's own channel (set-up errors, the
layers in place, how the program ended) is a pipe held only by two processes that run no solution
code, outside the solution's reach (below).

The sandbox (``run_tests``) runs each program as a fresh ``python -I -S -B`` (isolated mode: no
PYTHON* variables, no site-packages, no bytecode written: the standard library only), set up by
``child`` as a supervisor, the init of a new pid namespace, and the program, with:

- Linux namespaces (``isolation``): user (the uid mapped to itself; the capabilities it
  grants dropped after set-up), pid (nothing outside can be seen or signalled; the init's end is
  everything's end), network (no interface up: no connection anywhere, 127.0.0.1 included), IPC,
  and mount: every mount read-only and nosuid, an empty private /tmp, a /proc of its own, and the
  one writable place, the working directory, a tmpfs of its own whose bytes and files the kernel
  bounds (``disk_bytes``, ``max_files_written``), which ends with the namespace, with whatever
  the program left in it;
- Landlock (Linux 5.13): writes (making, removing, renaming) only in the working directory,
  reads only there and in the standard library, the system libraries and four devices, no file
  executed; no TCP bind or connect (ABI 4); no signal or abstract unix socket beyond the sandbox
  (ABI 6);
- seccomp-BPF: no execve, no new process (threads only), no socket or socket pair, no io_uring,
  no ptrace or other processes' memory, no namespace or mount, no kernel keys, BPF, perf or
  userfaultfd, and none of the memory RLIMIT_AS does not count: System V shared memory, message
  queues and semaphores, POSIX message queues, memfd files;
- when run as root, a uid of its own. RLIMIT_NPROC counts the processes of a real uid and is not
  enforced for root (in a user namespace too), so the supervisor drops (setgroups, setgid, setuid)
  to one of 64 unprivileged uids from 1879048192 (a range systemd's UID notes leave unused), one
  per program running at the time, claimed with a file lock. The uid makes the process limit
  hold, keeps the program out of root-owned files and lets the parent kill, after the run, every
  process of that uid. When the uid cannot read the standard library (an interpreter under
  /root), the supervisor first imports ``child.PRELOAD`` and the solution can import nothing
  else. Without root, the process limit holds in the user namespace (it counts the namespace's
  processes); without one either, RLIMIT_NPROC is 0: no process or thread;
- limits (``SandboxLimits``): CPU time, address space, file size, open files and processes
  (rlimits), and wall time (the parent kills it; should the parent die first, the supervisor's
  alarm, a second after the wall limit, kills the namespace);
- a fresh temporary directory as its working directory, HOME and TMPDIR (``workdir``; on the
  host it stays empty under the tmpfs, where there is one), locked while in use and removed
  afterwards whatever the program left there (any depth, any rights, FIFOs, links never
  followed), or by the next process's first run should the parent be killed; an environment of
  PATH, LANG, HOME and TMPDIR only: none of the trainer's variables. The parent opens nothing in
  it: the program's result and output come back through descriptors of files with no name;
- an audit hook (PEP 578): process creation, signals, sockets, ctypes, symlinks, writes outside
  the working directory (and more than ``max_files_written`` files) and reads outside it and the
  standard library refused in Python's terms, with clear errors for the usual accidents. It runs
  in the interpreter it guards and can be undone from there (frames, the garbage collector), so
  it is defence in depth, not the boundary.

A layer the kernel lacks or forbids (no unprivileged user namespaces, a kernel before Landlock,
another architecture for seccomp) is left out and the others hold; ``sandbox_isolation()`` says
which are in place, and the code reward's scorer prints it at start-up.

What it still is not: the kernel is shared, so a kernel bug reachable through the syscalls left
open (files in the working directory, memory, threads, futexes, pipes) is an escape; there is no
cgroup, so memory is bounded per process (RLIMIT_AS) and the working directory's tmpfs, CPU by
the time limits and the disk by the file limits; without seccomp, memfd files (``open_files`` of
``file_size_bytes``) and System V shared memory (in the sandbox's own IPC namespace, freed with
it) escape RLIMIT_AS while the program runs (descriptors passed into a socket's own queue hold
theirs until the kernel's collector, which the parent starts after each run); without namespaces, only the audit hook counts the
files written, so a program past it fills the disk for its wall time (what it leaves is removed);
without the kernel layers (a host without user namespaces, Landlock and seccomp), a
program past the audit hook can run commands and reach the network as the sandbox uid, or, when
the trainer is not root, as the trainer's own user, who may read the trainer's memory through
/proc (the expected values too). For hostile code at scale a VM boundary (gVisor, Firecracker)
is the stronger one. And the parent's own part of a test runs in the reward worker on values the
solution chose: bounded by size limits (a range counts its length), a step budget, sets and dicts
refused with more than a few values of one hash (building them is quadratic) and, where the check
runs alone in its process, an address-space limit; for what they miss (``sum(f(x), [])`` on a
long list) by the reward pool's timeout. Linux only (/proc, RLIMIT_NPROC as Linux counts it);
tests/test_code_sandbox.py holds the attacks (tests/attacks) each layer must stop,
tests/test_sandbox_host.py the host's state after each of those that aim at the host.

    run_tests       one program against its tests (run.py: processes, limits, the report)
    workdir.py      its working directory on the host: locked, removed whatever is in it, stale ones swept
    probes.py       a test split into the solution's probes and the rest; the program's report read
    checker.py      the rest of a test evaluated here on the probes' values
    child.py        the program the sandbox runs (supervisor, init, program)
    isolation.py    namespaces, Landlock, seccomp-BPF through ctypes
    uids.py         a uid per sandboxed program when the trainer is root
"""
from hflow.sandbox.run import LAYERS, RunResult, SandboxLimits, run_tests, sandbox_isolation
from hflow.sandbox.uids import SANDBOX_SLOTS, SANDBOX_UID_BASE

__all__ = ["LAYERS", "RunResult", "SandboxLimits", "run_tests", "sandbox_isolation", "SANDBOX_SLOTS",
           "SANDBOX_UID_BASE"]
