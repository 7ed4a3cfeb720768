"""TextArena's single-player games as hflow environments: `--agent.env textarena:GuessTheNumber-v0`.

    env = TextArenaEnv("GuessTheNumber-v0")
    env.reset({"seed": 3})        # the game's prompt: "[GAME] You are Player 0. You are playing Guess The Number..."
    env.step("[10]")              # StepResult("[GAME] The target number is lower.", reward=0.0, done=False)

reset(row) makes the game with `textarena.make(name)` and resets it for one player with the row's
seed (adapters.row_seed). The game's own action wrappers are kept (ActionFormattingWrapper: a
reply without square brackets is put in them); its observation wrappers are not: TextArena's
LLMObservationWrapper shows the whole history every turn, and an hflow trajectory already holds
it, so each observation is only what the game said since the model's last turn, in that wrapper's
lines ("[GAME] ..."), the model's own move left out (it is in the stream as sampled). The game's
reward comes with its last step (`env.close()`'s reward of player 0), 0 before.

Multi-player games (a second player would need a second policy) are refused by name, as is a
game that cannot start here (Wordle and the other word games need nltk's corpora downloaded;
some call an OpenRouter judge). Many games draw from Python's global `random` (and a few from
numpy's), which TextArena seeds on reset: each game here keeps its own state of both and swaps
it in around each of its calls, under one lock, so that games stepped side by side on threads
draw what each would alone and the process's own random state is left as it was.
"""
from __future__ import annotations

import functools
import random
import threading
from typing import Optional

import numpy as np

from hflow.agents.adapters import one_line, require, row_seed
from hflow.agents.environment import Environment, StepResult

# games that start for one player in textarena 0.7.4 (for the error that names some)
SINGLE_PLAYER_EXAMPLES = ("GuessTheNumber-v0", "TowerOfHanoi-v0", "Mastermind-v0", "Minesweeper-v0-small",
                          "Sudoku-v0-very-easy", "FrozenLake-v0", "Bandit-v0", "2048-v0-ultra-easy")

_RANDOM_LOCK = threading.RLock()


class OwnRandom:
    """One game's state of Python's and numpy's global random generators, in place only while
    `with` it (under a process-wide lock); the state outside is put back after."""

    def __init__(self, seed: int):
        self._py = random.Random(seed).getstate()
        self._np = np.random.RandomState(seed % 2**32).get_state()

    def __enter__(self):
        _RANDOM_LOCK.acquire()
        self._outside = random.getstate(), np.random.get_state()
        random.setstate(self._py)
        np.random.set_state(self._np)
        return self

    def __exit__(self, *exc):
        self._py, self._np = random.getstate(), np.random.get_state()
        random.setstate(self._outside[0])
        np.random.set_state(self._outside[1])
        _RANDOM_LOCK.release()


def make_game(ta, game: str, kwargs: Optional[dict] = None):
    """`textarena.make(game, **kwargs)` with its observation wrappers taken off, its action
    wrappers kept in their order."""
    env = ta.make(game, **(kwargs or {}))
    wrappers = []
    while isinstance(env, ta.Wrapper):
        wrappers.append(type(env))
        env = env.env
    for wrapper in reversed(wrappers):
        if issubclass(wrapper, ta.ActionWrapper):
            env = wrapper(env)
    return env


def _state(env):
    while not hasattr(env, "state") and hasattr(env, "env"):
        env = env.env
    return env.state


class TextArenaEnv(Environment):
    """One TextArena single-player game per trajectory (see the module docstring)."""

    def __init__(self, game: str, **kwargs):
        self.game, self.kwargs = game, kwargs
        self.env = None

    def reset(self, row: dict):
        ta = require("textarena", f"textarena:{self.game}")
        seed = row_seed(row)
        self._random = OwnRandom(seed)
        with self._random:
            self.env = make_game(ta, self.game, self.kwargs)
            self.env.reset(num_players=1, seed=seed)
            self.player, messages = self.env.get_observation()
        if not isinstance(_state(self.env), ta.SinglePlayerState):
            raise ValueError(f"textarena game {self.game} is not a single-player game")
        return self.observation(messages)

    def step(self, text: str) -> StepResult:
        with self._random:
            done, _ = self.env.step(text)
            reward = 0.0
            if done:
                closed = self.env.close()
                rewards = closed[0] if isinstance(closed, tuple) else closed   # (rewards, game_info) since 0.7
                reward = float((rewards or {}).get(self.player, 0.0))
            _, messages = self.env.get_observation()
        return StepResult(None if done else self.observation(messages), reward=reward, done=bool(done))

    def observation(self, messages) -> str:
        """The game's messages as its LLMObservationWrapper words them, one a line, the model's own left out."""
        ta = require("textarena", f"textarena:{self.game}")
        roles = _state(self.env).role_mapping
        lines = []
        for message in messages:
            sender, content = message[0], message[1]
            if sender == self.player:
                continue
            name = "GAME" if sender == ta.GAME_ID else roles.get(sender, f"Player {sender}")
            lines.append(f"[{name}] {content}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def check_game(game: str, spec: str) -> None:
    """The game exists and starts for one player here; a ValueError saying why not otherwise."""
    ta = require("textarena", spec)
    from textarena.envs.registration import ENV_REGISTRY
    if game not in ENV_REGISTRY:
        import difflib
        close = difflib.get_close_matches(game, list(ENV_REGISTRY), n=3)
        raise ValueError(f"environment {spec!r}: textarena {ta.__version__} has no game {game!r}"
                         + (f" (did you mean {', '.join(close)}?)" if close else
                            f"; its single-player games include {', '.join(SINGLE_PLAYER_EXAMPLES)}"))

    def start(players: int):
        with OwnRandom(0):
            env = make_game(ta, game)
            env.reset(num_players=players, seed=0)
            return _state(env)

    try:
        state = start(1)
    except Exception as e:   # a game for more players refuses one (an assertion, a ValueError)
        try:
            state = start(2)
        except Exception:
            raise ValueError(f"environment {spec!r}: textarena cannot start {game} here: {one_line(e)}") from None
    if not isinstance(state, ta.SinglePlayerState):
        raise ValueError(f"environment {spec!r}: {game} is a game for {state.num_players if state.num_players > 1 else 'several'} "
                         f"players; hflow trains one policy against an environment, so only TextArena's "
                         f"single-player games, e.g. {', '.join(SINGLE_PLAYER_EXAMPLES[:4])}")


def factory(game: str, spec: str):
    check_game(game, spec)
    return functools.partial(TextArenaEnv, game)
