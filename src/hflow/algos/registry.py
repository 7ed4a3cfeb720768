"""A table of functions by name that recipes pick from (`--algo.estimator grpo`, `--algo.loss gspo`)."""
from typing import Callable


class Registry(dict):
    """name -> function, for one kind of function (its name is in the messages)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable:
        """A decorator adding the function to the table as `name` (once)."""
        def add(fn: Callable) -> Callable:
            if name in self:
                raise ValueError(f"a {self.kind} named {name!r} is registered already")
            self[name] = fn
            return fn
        return add

    def find(self, name: str) -> Callable:
        """The function registered as `name`, or an error listing the registered ones."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self)}")
        return self[name]
