"""In-process stand-ins for worker groups, so that checkpoint.save_run / resume_run run without a
cluster: `group.save.future(path)` / `group.load.future(path)` call save_sharded / load_sharded
here. With remote=True a failure comes back as the controller would see it: a RemoteError that
carries only the worker's traceback text."""
import traceback

import torch

from hflow import checkpoint as ck
from hflow.controller import RemoteError


class _Done:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.value


class _Method:
    def __init__(self, fn, what, remote):
        self.fn, self.what, self.remote = fn, what, remote

    def future(self, *args):
        try:
            return _Done([self.fn(*args)])           # "all" dispatch: one result per rank
        except BaseException as e:
            if self.remote:
                e = RemoteError(0, self.what, "".join(traceback.format_exception(type(e), e, e.__traceback__)))
            return _Done(error=e)


class FakeGroup:
    def __init__(self, model, optimizer=None, scheduler=None, remote=True):
        self.model, self.optimizer = model, optimizer
        self.state = {"model": ck.ModelState(model, optimizer, scheduler)}
        self.save = _Method(lambda path: ck.save_sharded(path, self.state), "FakeWorker.save", remote)
        self.load = _Method(lambda path: ck.load_sharded(path, self.state), "FakeWorker.load", remote)


def trained_linear(n_in, n_out, seed=0, steps=1):
    """A linear layer with AdamW state after `steps` steps (so optimizer moments exist)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(n_in, n_out)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(3, n_in)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def params(model):
    return [p.detach().clone() for p in model.parameters()]
