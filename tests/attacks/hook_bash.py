# With the audit hook neutered: start bash, which writes a file into the host's /tmp.
import os

ran = os.system("bash -c 'echo escaped > __TARGET__; exit 7'") == 7 << 8


def f(x):
    return 2 * x if ran else 0
