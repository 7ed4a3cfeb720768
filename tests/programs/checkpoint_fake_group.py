"""In-process stand-ins for worker groups, so that checkpoint.save_run / resume_run run without a
cluster: `group.save.future(path)` / `group.load.future(path)` call save_sharded / load_sharded
here, as a worker's save / load does. With remote=True a failure comes back as the controller would
see it: a RemoteError that carries only the worker's traceback text. Under torchrun,
`save_on_ranks` / `resume_on_ranks` make rank 0 the controller and every rank a worker of one
group."""
import traceback

import torch
import torch.distributed as dist

from hflow import checkpoint as ck
from hflow.runtime.controller import RemoteError


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


# ---------------------------------------------------------------- the ranks of a torchrun as one group

class _RankZero:
    """Rank 0's part of a group that every rank of a torchrun plays: the save / load a worker
    runs (save_sharded / load_sharded over the default group), once it has told the other ranks
    the directory (they wait for it in `_others`)."""

    def __init__(self, state):
        self.told = False
        self.save = _Method(lambda path: self._run(ck.save_sharded, path, state), "RankGroup.save", remote=False)
        self.load = _Method(lambda path: self._run(ck.load_sharded, path, state), "RankGroup.load", remote=False)

    def _run(self, fn, path, state):
        self.tell(path)
        return fn(path, state)

    def tell(self, path):
        """Send the other ranks the directory to save to or load from (None: nothing to do)."""
        if not self.told:
            self.told = True
            dist.broadcast_object_list([path], src=0)


def _others(fn, state):
    path = [None]
    dist.broadcast_object_list(path, src=0)
    if path[0] is not None:
        fn(path[0], state)


def _as_controller(call, group):
    try:
        return call()
    finally:
        group.tell(None)          # the controller stopped before asking the group: release the ranks


def save_on_ranks(root, step, state, extra=None, keep_last=None):
    """Every rank calls this: rank 0 is the controller (`save_run`) and every rank a worker of the
    one group "actor", saving its shards of `state`. Returns once the checkpoint is committed;
    raises where the save failed (on rank 0, save_run's error)."""
    if dist.get_rank() == 0:
        group = _RankZero(state)
        _as_controller(lambda: ck.save_run(root, step, {"actor": group}, extra or {}, keep_last), group)
    else:
        _others(ck.save_sharded, state)
    dist.barrier()


def resume_on_ranks(root, state) -> dict | None:
    """Every rank calls this: rank 0 runs `resume_run`, every rank loads its part of `state`;
    returns resume_run's answer (the controller's state, with "step") on every rank."""
    if dist.get_rank() == 0:
        group = _RankZero(state)
        answer = [_as_controller(lambda: ck.resume_run(root, {"actor": group}), group)]
    else:
        _others(ck.load_sharded, state)
        answer = [None]
    dist.broadcast_object_list(answer, src=0)
    return answer[0]
