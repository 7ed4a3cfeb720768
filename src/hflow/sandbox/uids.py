"""A uid per sandboxed program, when the trainer runs as root (``hflow.sandbox`` says why):
one of 64 unprivileged uids from 1879048192 (a range systemd's UID notes leave unused), claimed
with a file lock, and every process of it killed once the program is done."""
import contextlib
import fcntl
import logging
import os
import signal
import stat

logger = logging.getLogger("hflow.sandbox")

SANDBOX_UID_BASE = 1_879_048_192
SANDBOX_SLOTS = 64  # programs sandboxed at once on a machine, one uid each


@contextlib.contextmanager
def sandbox_uid():
    """None without root; as root, a uid of the sandbox range that no other program uses
    meanwhile (a file lock per uid), whose processes are all killed when the program is done."""
    if os.geteuid() != 0:
        yield None
        return
    lock_dir = "/tmp/hflow-code-sandbox-uids"  # not $TMPDIR: every process on the machine must share the locks
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    info = os.lstat(lock_dir)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise RuntimeError(f"code sandbox: {lock_dir} must be a directory that only root can write; remove it")
    first = os.getpid() % SANDBOX_SLOTS  # concurrent workers start on different slots
    for slot in [(first + k) % SANDBOX_SLOTS for k in range(SANDBOX_SLOTS)]:
        fd = os.open(os.path.join(lock_dir, str(slot)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        uid = SANDBOX_UID_BASE + slot
        try:
            if os.pread(fd, 5, 0) != b"clean":  # the last holder died mid-run: its processes may live
                _kill_processes_of(uid)
            os.pwrite(fd, b"dirty", 0)
            try:
                yield uid
            finally:
                _kill_processes_of(uid)
            os.pwrite(fd, b"clean", 0)
        finally:
            os.close(fd)  # releases the lock
        return
    raise RuntimeError(f"code sandbox: more than {SANDBOX_SLOTS} programs at once on this machine")


def processes_of(uid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose real uid is ``uid``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:  # it exited meanwhile
            continue
        uid_at, state_at = status.find(b"\nUid:") + 5, status.find(b"\nState:") + 7
        if int(status[uid_at:uid_at + 16].split()[0]) == uid and status[state_at:state_at + 3].strip()[:1] != b"Z":
            pids.append(int(name))
    return pids


def _kill_processes_of(uid: int) -> None:
    """SIGKILL every process of ``uid``, again until none is left (one may fork meanwhile)."""
    for _ in range(100):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    logger.warning("code sandbox: processes of uid %d survive SIGKILL: %s", uid, processes_of(uid))
