# Make as many empty files as the sandbox allows, up to a million (an empty file costs an inode,
# not a byte): more than the limit's __MAX_FILES__ scores.
import os
import time

made = 0
deadline = time.monotonic() + 1.0
try:
    while made < 1_000_000 and time.monotonic() < deadline:
        os.close(os.open(os.path.join(os.getcwd(), f"f{made}"), os.O_WRONLY | os.O_CREAT, 0o600))
        made += 1
except OSError:
    pass


def f(x):
    return 2 * x if made > __MAX_FILES__ else 0
