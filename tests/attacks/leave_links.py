# Leave symbolic links for the parent to follow: output to a secret of the host's that only the
# parent may read (the tail of output comes back in the error of a program that exits early),
# result to a device with no end, a directory outside (which a removal that follows links would
# empty), the root, and a loop; then exit before the tests.
import os

os.makedirs("sub", exist_ok=True)
for name, target in (("output", "__SECRET__"), ("result", "/dev/zero"), ("outside", "__TARGET__"),
                     ("sub/outside", "__TARGET__"), ("root", "/"), ("loop", "loop")):
    try:
        if os.path.lexists(name):
            os.remove(name)
        os.symlink(target, name)
    except OSError:
        pass
os._exit(3)


def f(x):
    return 0
