import os

# Tests share 2 cores between many processes: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
