"""Reward functions for test_recipes.py's runs (`--reward.fn dapo_rewards:<name>`, with tests/programs on PYTHONPATH)."""


def length_parity(response, ground_truth, **extra):
    """1 for a response with an even number of characters: the tiny random policy's groups mix."""
    return float(len(response) % 2 == 0)


def constant(response, ground_truth, **extra):
    """The same score for everything: every group is dropped."""
    return 1.0


def nothing(response, ground_truth, **extra):
    """A broken reward function: it forgets to return (test_recipes' failed-scoring run)."""
    return None
