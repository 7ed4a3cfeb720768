# With the audit hook neutered: fork.
import os

forked = False
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    forked = True
except OSError:
    pass


def f(x):
    return 2 * x if forked else 0
