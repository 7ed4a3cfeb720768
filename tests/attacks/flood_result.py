# Fill the result with what costs the parent most to read: a range of 10**18 items, 16k ints that
# share a hash in a set, the longest ints the decoder takes, deep and wide nesting, indices int()
# refuses, "done" for every test; then exit.
import json
import os

P = 2 ** 61 - 1
values = [["range", "0x0", hex(10 ** 18), "0x1"], ["set", [["int", hex(k * P)] for k in range(1, 16001)]],
          ["list", [["int", "0x" + "f" * 60000]] * 3], ["list", [["list", [["none"]] * 100]] * 100]]
lines = ["ran"] + [f"value {i} {json.dumps(value)}" for i, value in enumerate(values)]
lines += ["value 4 " + "[" * 50000, "done \u00b2", "value \u0663 []"] + [f"done {i}" for i in range(8)]
text = ("\n".join(lines) + "\n").encode()
for fd in range(3, 64):
    try:
        os.write(fd, text)
    except OSError:
        pass
os._exit(0)


def f(x):
    return 0
