# With the audit hook neutered: write a file into the host's /tmp from Python itself.
wrote = False
try:
    with open("__TARGET__", "w") as out:
        out.write("escaped")
    wrote = True
except OSError:
    pass


def f(x):
    return 2 * x if wrote else 0
