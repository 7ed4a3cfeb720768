"""Tools and a score function for tests/test_agent_load.py, in a module of their own: each tool
worker process imports this module, and nothing heavier, to unpickle them."""
import time


def nap(seconds: float) -> str:
    """Sleep, then say when the call started (time.monotonic(), which every process shares on Linux).

    Args:
        seconds: How long.
    """
    started = time.monotonic()
    time.sleep(seconds)
    return repr(started)


def slow_match(response: str, ground_truth, **extra) -> float:
    """A score function that takes half a second (a judge model, a test suite): 1 for the answer."""
    time.sleep(0.5)
    return float(response.strip() == str(ground_truth))


def crash(code: int) -> str:
    """End the worker's process, as a segfault in C would.

    Args:
        code: The exit code.
    """
    import os
    os._exit(code)
