"""The program the code sandbox runs: ``python -I -S -B _code_child.py`` in a fresh temporary
directory, started by ``hflow.rewards.code.run_tests`` (whose docstring describes the sandbox).

It reads ``job.json`` (and deletes it: the solution must not read the tests), limits itself
(rlimits), drops to the sandbox uid when started as root, installs the audit hook, runs the
solution, then each test in the solution's namespace, and writes one line per outcome to the
``result`` file: ``<token> test <i> <0|1>``, or ``<token> error <why>`` when the solution itself
fails, or ``<token> fatal <why>`` when the sandbox could not be set up. The token, a random string
from the parent, keeps a solution from forging results by printing them.

Standard library only, and nothing imported after the uid drop but what the solution imports.
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
READABLE_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")


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
    outside it and the standard library. Defence in depth only: see hflow.rewards.code."""
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


def main() -> None:
    with open("job.json") as f:
        job = json.load(f)
    os.remove("job.json")
    token, source, tests = job["token"], job["source"], job["tests"]
    out = os.open("result", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def report(*words) -> None:
        line = " ".join([token, *map(str, words)]).replace("\n", " ")[:400]
        os.write(out, (line + "\n").encode())

    try:
        stdlib = [p for p in sys.path if os.path.isdir(p)]
        if job["uid"] is not None and not all(map(others_can_read, stdlib)):
            for name in PRELOAD:
                __import__(name)
        set_limits(job["limits"])
        # SIGALRM ends it should its parent die before the wall-time kill (e.g. the reward pool
        # killing a worker past --reward.timeout): RLIMIT_CPU does not count sleeping.
        signal.alarm(job["limits"]["alarm"])
        if job["uid"] is not None:
            drop_privileges(job["uid"])
        if job["audit_hook"]:
            install_audit_hook(os.getcwd(), job["limits"]["max_files_written"])
    except Exception as e:
        report("fatal", f"{type(e).__name__}: {e}")
        os._exit(0)
    del job
    # not "__main__": a demo block under `if __name__ == "__main__"` (often reading input()) stays out
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(source, "<solution>", "exec"), namespace)
    except BaseException as e:  # SystemExit too: a solution that exits passes nothing
        report("error", f"{type(e).__name__}: {e}")
        os._exit(0)
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), namespace)
            passed = 1
        except BaseException:
            passed = 0
        report("test", i, passed)
    os._exit(0)  # now: threads the solution left running do not hold the exit


if __name__ == "__main__":
    main()
