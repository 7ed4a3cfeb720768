"""A tool whose module takes 2 s to import in a tool worker (as one importing torch would), for
tests/test_agent_load.py; imported at once in the test's own process."""
import multiprocessing
import time

if multiprocessing.parent_process() is not None:
    time.sleep(2.0)


def quick(x: int) -> str:
    """Answer at once.

    Args:
        x: Anything.
    """
    return str(x)
