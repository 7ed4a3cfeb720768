# Leave directories that their owner cannot list, enter or change, the working directory itself
# last: a parent that is not root cannot remove what is in them without giving itself the right.
import os

for name in ("locked", "readonly"):
    os.makedirs(os.path.join(name, "inner"), exist_ok=True)
    with open(os.path.join(name, "inner", "file"), "w") as out:
        out.write("kept")
os.chmod("readonly", 0o500)
os.chmod(os.path.join("locked", "inner"), 0)
os.chmod("locked", 0)
os.chmod(".", 0)


def f(x):
    return 0
