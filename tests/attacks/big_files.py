# Write files as large as the file size limit allows until the disk refuses, each unlinked once
# written and kept open (so that no name counts it): more bytes than the limit's
# __MAX_FILES__ files of __FILE_BYTES__ bytes scores.
import os
import time

written, kept = 0, []
deadline = time.monotonic() + 1.0
chunk = b"x" * 65536
try:
    for i in range(100_000):
        if time.monotonic() > deadline:
            break
        path = os.path.join(os.getcwd(), f"big{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        kept.append(fd)
        os.remove(path)
        try:
            while True:
                written += os.write(fd, chunk)
        except OSError as e:  # EFBIG: this file is full; ENOSPC: the disk is
            if e.errno != 27:
                break
except OSError:
    pass


def f(x):
    return 2 * x if written > __MAX_FILES__ * __FILE_BYTES__ else 0
