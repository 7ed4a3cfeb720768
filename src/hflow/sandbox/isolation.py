"""The code sandbox's kernel layers: Linux namespaces, Landlock and seccomp-BPF, set up through
ctypes by ``child.py`` (the sandbox's trusted start-up code) before the solution runs.

Each function either takes effect or raises OSError (the kernel lacks the feature, or forbids
it here); the caller carries on without that layer and says so (``hflow.sandbox`` describes
the boundary they make). Imported by the child as a top-level module, so standard library only,
no relative imports. x86-64 and arm64 (seccomp needs the syscall numbers of the architecture).
"""
import ctypes
import os
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
CLONE_NEW_ANY = CLONE_NEWNS | 0x02000000 | 0x04000000 | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
CLONE_THREAD = 0x00010000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 1, 2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38
SYS_MOUNT_SETATTR, SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 442, 444, 445, 446


def _check(result: int, what: str) -> int:
    if result == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return result


# ---------------------------------------------------------------- namespaces

def enter_namespaces() -> None:
    """Move into new user, mount, pid, network and IPC namespaces. The uid and gid map to
    themselves: inside, the process keeps its ids (and, until it drops them, the capabilities
    the new user namespace grants over the others); outside it stays an unprivileged uid, so
    RLIMIT_NPROC still counts it. The caller's next child is pid 1 of the new pid namespace. The
    network namespace has only a loopback device, down."""
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC), "unshare")
    try:  # in the namespaces now: a failure is no longer "unavailable" but a sandbox half set up
        _prctl(PR_SET_DUMPABLE, 1, "PR_SET_DUMPABLE")  # a uid change made /proc/self root's: the maps too
        for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
        not_dumpable()
    except OSError as e:
        raise RuntimeError(f"new namespaces, but no uid map: {e}") from e


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    encode = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def _mount_setattr(path: str, flags: int, attr_set: int = 0, attr_clr: int = 0) -> None:
    attr = struct.pack("QQQQ", attr_set, attr_clr, 0, 0)  # struct mount_attr
    _check(_libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), os.fsencode(path),
                         ctypes.c_uint(flags), attr, ctypes.c_size_t(len(attr))), f"mount_setattr {path}")


def isolate_filesystem(workdir: str, tmp_bytes: int, work_bytes: int, work_files: int) -> list[str]:
    """In the new mount namespace: an empty private tmpfs on /tmp, at the working directory's path a
    tmpfs of ``work_bytes`` bytes and ``work_files`` files (the host's directory bound there, should
    a tmpfs not mount), writable, and every other mount read-only and nosuid. Returns what took
    effect; raises OSError when the namespace's mounts cannot be changed at all (then nothing
    was), RuntimeError when they were changed but not all the way."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates out, nor in
    try:
        return _private_tmp_and_read_only_root(workdir, tmp_bytes, work_bytes, work_files)
    except OSError as e:
        raise RuntimeError(f"mount namespace half set up: {e}") from e


def _private_tmp_and_read_only_root(workdir: str, tmp_bytes: int, work_bytes: int, work_files: int) -> list[str]:
    """``isolate_filesystem`` once the namespace's mounts are its own."""
    done = []
    workdir_fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # before /tmp is covered
    try:
        try:
            _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={tmp_bytes},mode=0755")
            done.append("private /tmp")
            os.makedirs(workdir, mode=0o700, exist_ok=True)  # its place on the new /tmp, if it was under /tmp
        except OSError:
            pass
        done.append(_working_directory(workdir, workdir_fd, work_bytes, work_files))
    finally:
        os.close(workdir_fd)
    try:
        _mount_setattr("/", AT_RECURSIVE, attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    except OSError as e:  # mount_setattr is Linux 5.12
        done.insert(0, f"no read-only root ({e})")
    else:
        _mount_setattr(workdir, 0, attr_clr=MOUNT_ATTR_RDONLY)  # the bind mount took it from its source
        done.insert(0, "read-only root")
    os.chdir(workdir)  # the old working directory is the directory under the new mount
    return done


def _working_directory(workdir: str, workdir_fd: int, work_bytes: int, work_files: int) -> str:
    """A tmpfs of the program's own at ``workdir``: the kernel bounds its bytes and files (inodes:
    one more for its root), and it ends with the namespace, with whatever the program left in it
    (a FIFO, a tree too deep, a chmod 000, a million files) and none of it on the host's disk.
    Failing that, the host's directory (``workdir_fd``) bound there."""
    try:
        _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"size={work_bytes},nr_inodes={work_files + 1},mode=0700")
        return f"tmpfs working directory ({work_bytes / 2 ** 20:g} MiB, {work_files} files)"
    except OSError as e:
        _mount(f"/proc/self/fd/{workdir_fd}", workdir, None, MS_BIND)
        return f"the host's working directory ({e})"


def mount_own_proc() -> str:
    """As pid 1 of the new pid namespace: a /proc that shows only its processes, or failing that
    an empty one."""
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        return "own /proc"
    except OSError:  # e.g. a container's /proc with locked mounts over parts of it
        _mount("tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4096")
        return "empty /proc"


# ---------------------------------------------------------------- process attributes

def _prctl(option: int, value: int, what: str) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0),
                       ctypes.c_ulong(0), ctypes.c_ulong(0)), what)


def not_dumpable() -> None:
    """No core dump, no ptrace, and /proc/<pid>/fd and mem owned by root: a sibling of the same
    uid cannot take this process's descriptors."""
    _prctl(PR_SET_DUMPABLE, 0, "PR_SET_DUMPABLE")


def die_with_parent(signal_number: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal_number, "PR_SET_PDEATHSIG")


def drop_capabilities() -> None:
    """Clear the effective, permitted and inheritable sets (those the user namespace granted)."""
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_libc.capset(header, bytes(24)), "capset")


def no_new_privileges() -> None:
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")


# ---------------------------------------------------------------- Landlock

_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_MAKE_CHAR, _FS_MAKE_BLOCK, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 6, 1 << 11, 1 << 14, 1 << 15
_FILE_ACCESS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2


def _landlock_fs_rights(abi: int) -> int:
    # ABI 1: 13 rights; 2 adds REFER; 3 TRUNCATE; 5 IOCTL_DEV
    return (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1


def landlock(workdir: str, read_paths: list[str], device_paths: list[str]) -> str:
    """Restrict this process and its children for good: files are written (made, removed,
    renamed) only under ``workdir``, read only there and under ``read_paths``; ``device_paths``
    may be read and written; and, as the ABI allows, no TCP bind or connect (ABI 4), no signal
    and no abstract unix socket beyond the sandbox (ABI 6). Returns a description."""
    abi = _libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint(1))
    _check(abi, "landlock ABI")
    fs = _landlock_fs_rights(abi)
    fields = [fs] + ([_NET_BIND_TCP | _NET_CONNECT_TCP] if abi >= 4 else [])
    fields += [_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL] if abi >= 6 else []
    attr = struct.pack(f"{len(fields)}Q", *fields)  # struct landlock_ruleset_attr, as long as this ABI knows it
    ruleset = _check(_libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), attr, ctypes.c_size_t(len(attr)),
                                   ctypes.c_uint(0)), "landlock_create_ruleset")
    try:
        _landlock_allow(ruleset, workdir, fs & ~(_FS_EXECUTE | _FS_MAKE_CHAR | _FS_MAKE_BLOCK | _FS_IOCTL_DEV))
        for path in read_paths:
            _landlock_allow(ruleset, path, _FS_READ_FILE | _FS_READ_DIR)
        for path in device_paths:
            _landlock_allow(ruleset, path, _FS_READ_FILE | _FS_WRITE_FILE | (fs & _FS_TRUNCATE))
        no_new_privileges()  # landlock_restrict_self requires it (without CAP_SYS_ADMIN)
        _check(_libc.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint(0)),
               "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return f"landlock ABI {abi}"


def _landlock_allow(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # not on this machine: nothing to allow
    try:
        if not os.path.isdir(path):
            access &= _FILE_ACCESS  # the kernel refuses directory rights on a file
        rule = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr (packed)
        _check(_libc.syscall(ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset), ctypes.c_int(1),
                             rule, ctypes.c_uint(0)), f"landlock_add_rule {path}")
    finally:
        os.close(fd)


# ---------------------------------------------------------------- seccomp-BPF

# Syscalls refused with EPERM: program execution, sockets (socketpair too: descriptors passed
# into a socket's own queue outlive the program until the kernel's collector finds them),
# io_uring (its operations would bypass this filter), other processes' memory, namespaces and
# mounts, kernel keys, BPF, perf, userfaultfd (a race helper), handles that skip path checks,
# kernel modules and kexec; and memory the address-space limit does not count: System V shared
# memory (a detached segment lives on; on the host's IPC namespace where the sandbox has none),
# message queues and semaphores, POSIX message queues, memfd files.
_REFUSED = ("execve", "execveat", "socket", "socketpair", "io_uring_setup", "io_uring_enter", "io_uring_register",
            "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "unshare", "setns",
            "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
            "fsmount", "fspick", "mount_setattr", "keyctl", "add_key", "request_key", "bpf",
            "perf_event_open", "userfaultfd", "open_by_handle_at", "kexec_load", "init_module",
            "finit_module", "delete_module", "shmget", "shmat", "msgget", "semget", "mq_open", "memfd_create",
            "memfd_secret")
_COMMON = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
           "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435,
           "pidfd_getfd": 438, "mount_setattr": 442, "memfd_secret": 447}
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(_COMMON, execve=59, execveat=322, socket=41, socketpair=53, ptrace=101,
                                process_vm_readv=310, process_vm_writev=311, unshare=272, setns=308, mount=165,
                                umount2=166, pivot_root=155, chroot=161, keyctl=250, add_key=248, request_key=249,
                                bpf=321, perf_event_open=298, userfaultfd=323, open_by_handle_at=304,
                                kexec_load=246, init_module=175, finit_module=313, delete_module=176, shmget=29,
                                shmat=30, msgget=68, semget=64, mq_open=240, memfd_create=319, clone=56, fork=57,
                                vfork=58)),
    "aarch64": (0xC00000B7, dict(_COMMON, execve=221, execveat=281, socket=198, socketpair=199, ptrace=117,
                                 process_vm_readv=270, process_vm_writev=271, unshare=97, setns=268, mount=40,
                                 umount2=39, pivot_root=41, chroot=51, keyctl=219, add_key=217, request_key=218,
                                 bpf=280, perf_event_open=241, userfaultfd=282, open_by_handle_at=265,
                                 kexec_load=104, init_module=105, finit_module=273, delete_module=106, shmget=194,
                                 shmat=196, msgget=186, semget=190, mq_open=180, memfd_create=279, clone=220)),
}
_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ALLOW = 0x80000000, 0x7FFF0000
_ERRNO_EPERM, _ERRNO_ENOSYS = 0x00050000 | 1, 0x00050000 | 38
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0 = 0, 4, 16  # struct seccomp_data, little-endian


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def seccomp_program(machine: str, refuse_processes: bool) -> bytes:
    """The BPF filter: the ``_REFUSED`` syscalls fail with EPERM, as do clone with a namespace
    flag and (``refuse_processes``) fork, vfork and a clone that is not a thread; clone3 fails
    with ENOSYS (its flags are out of a filter's reach; libc falls back to clone); another
    architecture's syscall ABI kills the process."""
    if machine not in _SYSCALLS:
        raise OSError(f"seccomp: no syscall table for {machine}")
    arch, numbers = _SYSCALLS[machine]
    program = [_insn(_LD_ABS_W, _OFFSET_ARCH), _insn(_JEQ, arch, jt=1), _insn(_RET, _RET_KILL_PROCESS),
               _insn(_LD_ABS_W, _OFFSET_NR)]
    if machine == "x86_64":  # the x32 ABI: the same arch, syscall numbers from 0x40000000
        program += [_insn(_JGE, 0x40000000, jf=1), _insn(_RET, _ERRNO_EPERM)]
    refused = [(numbers[name], _ERRNO_EPERM) for name in _REFUSED] + [(numbers["clone3"], _ERRNO_ENOSYS)]
    if refuse_processes:
        refused += [(numbers[name], _ERRNO_EPERM) for name in ("fork", "vfork") if name in numbers]
    for number, action in refused:
        program += [_insn(_JEQ, number, jf=1), _insn(_RET, action)]
    flags_check = [_insn(_LD_ABS_W, _OFFSET_ARG0), _insn(_JSET, CLONE_NEW_ANY, jf=1), _insn(_RET, _ERRNO_EPERM)]
    if refuse_processes:  # a thread shares the process (CLONE_THREAD): allowed; a new process: not
        flags_check += [_insn(_JSET, CLONE_THREAD, jt=1), _insn(_RET, _ERRNO_EPERM)]
    program += [_insn(_JEQ, numbers["clone"], jf=len(flags_check))] + flags_check
    program.append(_insn(_RET, _RET_ALLOW))
    return b"".join(program)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp(refuse_processes: bool) -> str:
    """Install the filter on this process and its future children, for good."""
    program = seccomp_program(os.uname().machine, refuse_processes)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    no_new_privileges()  # a filter without CAP_SYS_ADMIN requires it
    _check(_libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(2), ctypes.byref(fprog),
                       ctypes.c_ulong(0), ctypes.c_ulong(0)), "seccomp")
    return "seccomp"
