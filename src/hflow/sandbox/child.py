"""The program the code sandbox runs: ``python -I -S -B`` loading this module (and
``isolation``) from the parent's bytecode and calling ``main()``, in a fresh temporary
directory, started by ``hflow.sandbox.run_tests`` (whose package docstring describes the sandbox).
Standard library only, no relative imports; after the uid drop it imports nothing but what the
solution imports.

Three processes, each setting up the next:

- the supervisor (the process ``run_tests`` starts, as root when the trainer is): reads
  ``job.json`` and deletes it, drops to the sandbox uid, enters new namespaces and isolates the
  filesystem (``isolation``: the working directory a tmpfs of its own), starts the init and waits
  for it, holding the lock that keeps the host's working directory from ``workdir.sweep_stale``;
  at its alarm (the parent died before the wall-time kill) it kills the init, and with it the pid
  namespace;
- the init, pid 1 of the new pid namespace: mounts its /proc, drops the namespace's capabilities,
  restricts itself for good (Landlock, seccomp), reports on the status pipe which layers hold
  (``ready <layers>``), starts the program and reports how it ended (``exit <wait status>``);
- the program: refuses itself new processes (seccomp), limits itself (rlimits), installs the audit
  hook, closes the status pipe and runs the solution, then each probe (``probes``: the parts
  of the tests that call into the solution) in its namespace, writing to the result file
  ``ran`` (the solution ran), ``value <j> <encoded value>`` or ``raised <j> <exception>`` per
  probe, ``done <i>`` after test i's, or ``error <why>`` when the solution itself failed.

The status pipe is the trusted channel: only the supervisor and the init, which run no solution
code, hold it (a ``fatal <why>`` there says the sandbox could not be set up). The result file
(a descriptor the parent passes, of a file with no name) is the solution's to write as it likes:
the parent takes from it nothing but plain values.
"""
import json
import os
import resource
import signal
import stat
import sys

# Modules solutions commonly use, imported before the uid drop when the sandbox uid cannot read
# the standard library (an interpreter under /root): it imports nothing afterwards.
PRELOAD = ("math", "cmath", "itertools", "functools", "collections", "heapq", "bisect", "re",
           "string", "operator", "random", "fractions", "decimal", "copy", "json", "datetime",
           "typing", "statistics", "array", "time")

REFUSED_EVENTS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                  "subprocess.Popen", "os.kill", "os.killpg", "os.symlink", "os.link",
                  "os.setxattr", "os.removexattr", "resource.setrlimit", "resource.prlimit"}
REFUSED_PREFIXES = ("socket.", "ctypes.")
REFUSED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess", "_socket", "_multiprocessing"}
# event -> (indices of path arguments, index of the dir_fd argument or None)
WRITE_EVENTS = {"os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2),
                "os.rename": ((0, 1), 2), "os.chmod": ((0,), 2), "os.chown": ((0,), 3),
                "os.utime": ((0,), 3), "os.truncate": ((0,), None), "os.mkfifo": ((0,), 2),
                "os.mknod": ((0,), 3)}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
READABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
# Besides the standard library: what the dynamic loader and the time functions read (Landlock)
SYSTEM_READS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache",
                "/etc/localtime", "/usr/share/zoneinfo")
MAX_VALUE_NODES = 1 << 17   # as hflow.sandbox.probes decodes
MAX_VALUE_DEPTH = 64
_DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))


def set_limits(limits: dict) -> None:
    core = {"cpu": resource.RLIMIT_CPU, "memory": resource.RLIMIT_AS,
            "file_size": resource.RLIMIT_FSIZE, "processes": resource.RLIMIT_NPROC,
            "open_files": resource.RLIMIT_NOFILE}
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # os.abort() or a segfault leaves no core file
    for name, which in core.items():
        soft = limits[name]
        # The CPU soft limit sends SIGXCPU (a solution can catch it); the hard one, a second later, SIGKILL.
        resource.setrlimit(which, (soft, soft + 1 if name == "cpu" else soft))


def others_can_read(directory: str) -> bool:
    """Whether a uid with no rights of its own can list ``directory`` and reach it from /."""
    if not os.stat(directory).st_mode & stat.S_IROTH:
        return False
    while directory != "/":
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return False
        directory = os.path.dirname(directory)
    return True


def drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)  # as root: real, effective and saved uid, so it cannot be taken back


def install_audit_hook(workdir: str, max_files_written: int) -> None:
    """Refuse process creation, signals, sockets, ctypes, writes outside ``workdir`` and reads
    outside it and the standard library. Defence in depth only: see hflow.sandbox."""
    realpath = os.path.realpath
    fsdecode = os.fsdecode
    read_roots = tuple({realpath(p) for p in sys.path if p}) + (workdir,)
    files_written = [0]

    def inside(path, roots) -> bool:
        if isinstance(path, int):
            return True  # an open descriptor: opening it was checked
        path = realpath(fsdecode(path))
        return any(path == root or path.startswith(root + "/") for root in roots)

    def refuse(what: str):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def hook(event: str, args: tuple) -> None:
        if event in REFUSED_EVENTS or event.startswith(REFUSED_PREFIXES):
            refuse(event)
        if event == "import" and args[0] in REFUSED_IMPORTS:
            refuse(f"import {args[0]}")
        if event == "object.__setattr__" and args[0] is hook:
            refuse("changing the audit hook")
        if event == "open":
            path, mode, flags = args
            if flags & WRITE_FLAGS:
                # os.open (mode None) may be relative to a dir_fd this event does not show
                if mode is None and not isinstance(path, int) and not os.path.isabs(path):
                    refuse(f"os.open of relative path {path!r} for writing (give an absolute path)")
                if not inside(path, (workdir,)):
                    refuse(f"writing {path!r} outside the working directory")
                files_written[0] += 1
                if files_written[0] > max_files_written:
                    refuse(f"opening more than {max_files_written} files for writing")
            elif not (inside(path, read_roots) or path in READABLE_DEVICES):
                refuse(f"reading {path!r} outside the working directory and the standard library")
        elif event in WRITE_EVENTS:
            path_indices, dir_fd_index = WRITE_EVENTS[event]
            if dir_fd_index is not None and args[dir_fd_index] not in (-1, None):
                refuse(f"{event} with dir_fd")
            for i in path_indices:
                if not inside(args[i], (workdir,)):
                    refuse(f"{event} {args[i]!r} outside the working directory")

    sys.addaudithook(hook)


def encode(value, depth: int = 0, budget=None) -> list:
    """``value`` as plain data for the parent (``probes.decode``): None, bool, int, float,
    complex, str, bytes, list, tuple, dict, set, frozenset, range, a dict view (as a list) or an
    iterator (its items), subclasses as their base type; TypeError for anything else."""
    budget = [MAX_VALUE_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_VALUE_DEPTH:
        raise ValueError("too big a value to send")
    items = lambda values: [encode(v, depth + 1, budget) for v in values]  # noqa: E731
    if value is None:
        return ["none"]
    if isinstance(value, bool):
        return ["bool", bool(value)]
    if isinstance(value, int):
        return ["int", hex(int(value))]
    if isinstance(value, float):
        return ["float", float(value).hex()]
    if isinstance(value, complex):
        return ["complex", value.real.hex(), value.imag.hex()]
    if isinstance(value, str):
        return ["str", str.__str__(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", bytes(value).hex()]
    if isinstance(value, range):
        return ["range", hex(value.start), hex(value.stop), hex(value.step)]
    if isinstance(value, dict):
        return ["dict", [[encode(k, depth + 1, budget), encode(v, depth + 1, budget)] for k, v in value.items()]]
    for kind in (list, tuple, set, frozenset):
        if isinstance(value, kind):
            return [kind.__name__, items(value)]
    if isinstance(value, _DICT_VIEWS):
        return ["list", items(value)]
    if hasattr(type(value), "__next__") and hasattr(type(value), "__iter__"):
        collected = []
        for item in value:  # an endless one runs out of budget
            collected.append(encode(item, depth + 1, budget))
        return ["iterator", collected]
    raise TypeError(f"{type(value).__name__} is not plain data")


def main() -> None:
    """The supervisor."""
    with open("job.json") as f:
        job = json.load(f)
    os.remove("job.json")
    status, workdir, without = job["status_fd"], os.getcwd(), set(job["without"])
    try:
        stdlib = [p for p in sys.path if os.path.isdir(p)]
        if job["uid"] is not None and not all(map(others_can_read, stdlib)):
            for name in PRELOAD:
                __import__(name)
        isolation = _import_isolation()
        if job["uid"] is not None:
            drop_privileges(job["uid"])
        entered, why_not = _try(isolation.enter_namespaces, "namespaces" in without)
        details = None  # of the namespaces, once entered
        if entered:
            limits = job["limits"]
            done, filesystem = _try(lambda: ", ".join(isolation.isolate_filesystem(
                workdir, 1 << 20, limits["work_bytes"], limits["max_files_written"])))
            details = [filesystem if done else f"no mount isolation: {filesystem}"]
        init = os.fork()
        if init == 0:
            _init(job, isolation, details, why_not)
    except Exception as e:
        _report(status, "fatal", f"{type(e).__name__}: {e}")
        os._exit(0)
    os.close(status)

    def on_alarm(signum, frame):
        os.kill(init, signal.SIGKILL)  # as pid 1 of its namespace: the kernel kills all the rest
        if job["uid"] is not None:
            os.kill(-1, signal.SIGKILL)  # and every other process of the sandbox uid
        os._exit(1)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(job["limits"]["alarm"])
    os.waitpid(init, 0)
    os._exit(0)


def _import_isolation():
    try:
        import isolation  # loaded by the parent's bootstrap (hflow.sandbox.run._CHILD)
        return isolation
    except ImportError as e:  # an interpreter built without ctypes
        return _NoKernelLayers(f"no ctypes: {e}")


class _NoKernelLayers:
    """Stands for ``isolation`` where it cannot load: every layer is unavailable."""

    def __init__(self, reason: str):
        self.reason = reason

    def __getattr__(self, name):
        def unavailable(*args, **kwargs):
            raise OSError(self.reason)
        return unavailable


def _try(step, left_out: bool = False) -> tuple[bool, str]:
    """(True, what ``step()`` returned) once it took effect, else (False, why not)."""
    if left_out:
        return False, "left out"
    try:
        return True, step()
    except OSError as e:
        return False, str(e)


def _report(fd: int, *words) -> None:
    os.write(fd, (" ".join(map(str, words)).replace("\n", " ") + "\n").encode())


def _init(job: dict, isolation, details, why_no_namespaces: str) -> None:
    status, workdir, without = job["status_fd"], os.getcwd(), set(job["without"])
    own_namespaces = details is not None
    os.close(job["lock_fd"])  # the supervisor's to hold: the host's directory, which the program has no use for
    try:
        if own_namespaces:
            done, proc = _try(isolation.mount_own_proc)
            details.append(proc if done else f"the host's /proc: {proc}")
            isolation.drop_capabilities()
        _try(lambda: isolation.die_with_parent(signal.SIGKILL))  # the supervisor killed: this ends too
        read_paths = sorted({os.path.realpath(p) for p in sys.path if p} | set(SYSTEM_READS))
        done, landlock = _try(lambda: isolation.landlock(workdir, read_paths, list(READABLE_DEVICES)),
                              "landlock" in without)
        seccomp, why_not = _try(lambda: isolation.seccomp(refuse_processes=False), "seccomp" in without)
        layers = [f"user+pid+net+ipc+mount namespaces ({', '.join(details)})" if own_namespaces
                  else f"no namespaces ({why_no_namespaces})", landlock if done else f"no landlock ({landlock})", "seccomp" if seccomp else f"no seccomp ({why_not})",
                  "uid drop" if job["uid"] is not None else "no uid drop (not root)", "rlimits",
                  "audit hook" if "audit_hook" not in without else "no audit hook (left out)"]
        _report(status, "ready", ", ".join(layers))
        program = os.fork()
        if program == 0:
            _program(job, isolation, seccomp, own_namespaces)
        while True:  # as pid 1 it also reaps the namespace's orphans
            pid, wait_status = os.waitpid(-1, 0)
            if pid == program:
                break
        _report(status, "exit", wait_status)
    except Exception as e:
        _report(status, "fatal", f"{type(e).__name__}: {e}")
    os._exit(0)  # as pid 1: the kernel kills whatever the program left in the namespace


def _program(job: dict, isolation, seccomp: bool, own_namespaces: bool) -> None:
    status, workdir = job["status_fd"], os.getcwd()
    try:
        _try(lambda: isolation.die_with_parent(signal.SIGKILL))
        if seccomp:
            isolation.seccomp(refuse_processes=True)
        out = job["result_fd"]
        limits = dict(job["limits"])
        if job["uid"] is None and not own_namespaces:
            limits["processes"] = 0  # the count is then the trainer's user's: only 0 bounds the program's
        set_limits(limits)
        for name in [n for n in sys.modules if n.split(".")[0] in ("ctypes", "_ctypes", "isolation")]:
            del sys.modules[name]  # so that `import ctypes` meets the audit hook again
        if "audit_hook" not in job["without"]:
            install_audit_hook(workdir, limits["max_files_written"])
    except Exception as e:
        _report(status, "fatal", f"{type(e).__name__}: {e}")
        os._exit(0)
    os.close(status)
    source, probes = job["source"], job["probes"]

    def report(*words) -> None:
        line = (" ".join(map(str, words)).replace("\n", " ") + "\n").encode()
        while line:
            line = line[os.write(out, line):]

    # not "__main__": a demo block under `if __name__ == "__main__"` (often reading input()) stays out
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(source, "<solution>", "exec"), namespace)
    except BaseException as e:  # SystemExit too: a solution that exits passes nothing
        report("error", f"{type(e).__name__}: {e}"[:400])
        os._exit(0)
    report("ran")
    index = 0
    for test, test_probes in enumerate(probes):
        for probe in test_probes:
            try:
                value = eval(compile(probe["source"], f"<test {test}>", probe["mode"]), namespace)
                report("value", index, json.dumps(encode(value) if probe["keep"] else ["none"]))
            except BaseException as e:
                report("raised", index, type(e).__name__)
            index += 1
        report("done", test)
    os._exit(0)  # now: threads the solution left running do not hold the exit


if __name__ == "__main__":
    main()
