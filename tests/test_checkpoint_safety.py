"""Loading a checkpoint runs no code from it: the controller's state is JSON (extra.json), every
rank's RNG state a JSON string, and DCP's pickles (.metadata, the small non-tensor entries) are read
through allowlists. Each crafted file below would create a marker file if it were unpickled the
usual way; loading it raises CheckpointError instead and the marker stays absent. And every value
the controller really saves comes back bit for bit."""
import math
import pickle
import random

import numpy as np
import pytest
import torch

from hflow import checkpoint as ck
from hflow.algos.kl_control import AdaptiveKLController, FixedKLController
from hflow.algos.lagrangian import LagrangeMultiplier
from hflow.data.loading import PromptDataset
from hflow.data.sampler import PromptSampler
from programs.checkpoint_fake_group import FakeGroup, trained_linear


class Evil:
    """Unpickling this opens (creates) `marker`: what a malicious checkpoint would do, harmlessly."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _sampler():
    data = PromptDataset([[i, i + 1] for i in range(10)], [f"p{i}" for i in range(10)], [str(i) for i in range(10)],
                         [{} for _ in range(10)], source="test")
    sampler = PromptSampler(data, batch_size=3, seed=7)
    for _ in range(5):                              # into the second epoch
        next(sampler)
    return sampler, data


def test_the_controller_state_round_trips_bit_for_bit_through_extra_json(tmp_path):
    sampler, data = _sampler()
    kl = AdaptiveKLController(0.05, target_kl=6.0, horizon=10000)
    for measured in (1.3, 9.7, 6.1):
        kl.update(measured, 64)
    lam = LagrangeMultiplier(0.0, lr=0.1, lambda_max=0.0)          # log λ = -inf
    lam2 = LagrangeMultiplier(1.7, lr=0.1, lambda_max=10.0)
    lam2.update(0.37, 0.1)
    random.seed(3)
    torch.manual_seed(3)
    np.random.seed(3)
    torch.randn(5)
    random.gauss(0, 1)                              # a cached gaussian in random's state
    extra = {"data": sampler.state_dict(), "kl_ctrl": kl.state_dict(), "fixed": FixedKLController(0.1).state_dict(),
             "lambda": lam.state_dict(), "lambda2": lam2.state_dict(), "rng": ck.rng_state(),
             "misc": {1: (2, b"\x00\xff"), "__hflow__": [None, True, 2**70, -0.0, math.nan],
                      "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16), "scalar": torch.tensor(3)}}
    entry = ck.write_extra(tmp_path, extra)
    assert (tmp_path / "extra.json").stat().st_size == entry["size"]
    got = ck.read_extra(tmp_path)

    assert got["data"] == sampler.state_dict() and got["kl_ctrl"] == kl.state_dict()
    assert got["kl_ctrl"]["value"].hex() == kl.value.hex() and got["lambda"] == {"log_value": -math.inf}
    assert got["lambda2"]["log_value"].hex() == lam2.log_value.hex() and got["fixed"] == {"value": 0.1}
    misc = got["misc"]
    assert misc[1] == (2, b"\x00\xff") and misc["__hflow__"][:3] == [None, True, 2**70]
    assert math.copysign(1, misc["__hflow__"][3]) == -1 and math.isnan(misc["__hflow__"][4])
    assert misc["bf16"].dtype == torch.bfloat16 and torch.equal(misc["bf16"], extra["misc"]["bf16"])
    assert misc["scalar"].shape == () and misc["scalar"].item() == 3

    # the objects load it back and continue exactly as the originals do
    sampler2 = PromptSampler(data, batch_size=3, seed=7)
    sampler2.load_state_dict(got["data"])
    assert [p.index for p in next(sampler2)] == [p.index for p in next(sampler)]
    kl2 = AdaptiveKLController(1.0, target_kl=6.0, horizon=10000)
    kl2.load_state_dict(got["kl_ctrl"])
    kl.update(4.2, 64), kl2.update(4.2, 64)
    assert kl2.value.hex() == kl.value.hex()
    draws = lambda: (torch.randn(4).tolist(), random.gauss(0, 1), random.random(), np.random.rand(3).tolist())
    expected = draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    ck.set_rng_state(got["rng"])
    assert draws() == expected


def test_a_value_that_json_cannot_hold_is_refused_when_saving_naming_its_key(tmp_path):
    with pytest.raises(TypeError, match=r"extra\['kl'\]\['fn'\]: a builtins.function"):
        ck.write_extra(tmp_path, {"kl": {"fn": lambda: 0}})


def _checkpoint(root, step=1):
    model, opt = trained_linear(8, 8)
    ck.save_run(root, step, {"actor": FakeGroup(model, opt)}, {"data": {"position": 1}})
    return root / f"step_{step}"


def _rewrite_manifest(path):
    # an attacker who can write the checkpoint can write its manifest too
    (path / ck.MANIFEST).unlink()
    ck.integrity.write_manifest(path, ck.checkpoint_step(path))


def test_a_crafted_dcp_metadata_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = _checkpoint(tmp_path / "ckpt")
    (path / "actor" / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    _rewrite_manifest(path)
    state = FakeGroup(*trained_linear(8, 8, seed=1)).state
    with pytest.raises(ck.CheckpointError, match=r"actor/.metadata: refused to unpickle \w+\.open"):
        ck.load_sharded(path / "actor", state)
    with pytest.raises(ck.CheckpointError, match=r"refused to unpickle \w+\.open"):
        ck.resume_run(tmp_path / "ckpt", {"actor": FakeGroup(*trained_linear(8, 8, seed=1))})
    assert not marker.exists()


def test_a_crafted_entry_inside_a_shard_is_refused_not_run(tmp_path):
    """DCP stores non-tensor entries (schedules, hyper-parameters) as pickles inside the shard
    files and unpickles them with weights_only=False."""
    marker = tmp_path / "ran"
    path = tmp_path / "step_1" / "actor"
    ck.save_sharded(path, {"t": torch.ones(2), "entry": Evil(marker)})
    assert not marker.exists()
    with pytest.raises(ck.CheckpointError, match=r"step 1 .*refused to load the entry 'entry'.*\w+\.open"):
        ck.load_sharded(path, {"t": torch.zeros(2), "entry": None})
    assert not marker.exists()


def test_rng_state_in_dcp_is_json_and_an_older_pickled_one_still_loads_but_a_crafted_one_does_not(tmp_path):
    saved = ck.RNGState().state_dict()["rank0"]
    assert isinstance(saved, str) and "__hflow__" in saved
    random.seed(5)
    torch.manual_seed(5)
    older = pickle.dumps(ck.rng_state())               # what hflow stored before
    expected = (torch.rand(2).tolist(), random.random())
    ck.RNGState().load_state_dict({"rank0": older})
    assert (torch.rand(2).tolist(), random.random()) == expected

    marker = tmp_path / "ran"
    with pytest.raises(ck.CheckpointError, match=r"rank 0's RNG state: refused to unpickle \w+\.open"):
        ck.RNGState().load_state_dict({"rank0": pickle.dumps(Evil(marker))})
    assert not marker.exists()
