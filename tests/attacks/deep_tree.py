# Nest directories deeper than Python's recursion limit (a removal that recurses once per level
# fails: shutil.rmtree raised RecursionError, which ignore_errors does not catch), a file at the end.
import os

depth = 0
try:
    while depth < 1500:
        os.mkdir("d")
        os.chdir("d")
        depth += 1
    with open("bottom", "w") as out:
        out.write("kept")
except OSError:
    pass


def f(x):
    return 0
