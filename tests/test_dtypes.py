"""Dtypes on the GPU path, checked on CPU: frozen models are built in the compute dtype while
trainable ones keep fp32 masters; entropy is computed in fp32; the engine CLI's default dtype."""
import pytest
import torch
from dist import torchrun
from test_fsdp import TESTS_ENV, tiny_model_dir

from hflow.algos import entropy_from_logits
from hflow.engine.__main__ import default_dtype

FROZEN = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from hflow.workers.fsdp import FSDPConfig, free_gathered_params, storage_dtype
from hflow.workers.hf_model import build_model
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
cfg = FSDPConfig(param_dtype="bfloat16")   # the GPU default ("auto"), asked for on CPU
assert storage_dtype(FSDPConfig(), torch.device("cuda", 0), False) == torch.bfloat16
assert storage_dtype(FSDPConfig(), torch.device("cpu"), False) == torch.float32
frozen = build_model(sys.argv[1], mesh, cfg, trainable=False)
trained = build_model(sys.argv[1], mesh, cfg, trainable=True)
reward = build_model(sys.argv[1], mesh, cfg, kind="reward", trainable=False)
dtypes = lambda m: {p.to_local().dtype for p in m.parameters()}
assert dtypes(frozen) == dtypes(reward) == {torch.bfloat16}, (dtypes(frozen), dtypes(reward))
assert dtypes(trained) == {torch.float32}, dtypes(trained)
assert not any(p.requires_grad for p in frozen.parameters())
# the same bf16 forward: rounding at load == FSDP's cast of the fp32 masters at each forward
from hflow.workers.packing import pack
from test_fsdp import random_rollouts
inputs = pack(random_rollouts(2, 2, 101, seed=1)).model_inputs()
with torch.no_grad():
    a, b = frozen(**inputs).logits, trained(**inputs).logits
free_gathered_params(frozen), free_gathered_params(trained)
assert a.dtype == b.dtype == torch.bfloat16
assert torch.equal(a, b), (a - b).abs().max()
frozen_bytes = sum(p.to_local().nbytes for p in frozen.parameters())
trained_bytes = sum(p.to_local().nbytes for p in trained.parameters())
print("frozen bytes", frozen_bytes, "trainable bytes", trained_bytes, flush=True)
assert 2 * frozen_bytes == trained_bytes
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_frozen_models_are_built_in_the_compute_dtype(tmp_path):
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(FROZEN, nproc=1, args=[path], tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    assert "frozen bytes" in run.output


def test_entropy_is_computed_in_fp32():
    torch.manual_seed(0)
    logits = (torch.randn(4, 7, 32000) * 3).to(torch.bfloat16)
    h = entropy_from_logits(logits)
    assert h.dtype == torch.float32
    logp = torch.log_softmax(logits.double(), -1)
    exact = -(logp.exp() * logp).sum(-1)
    assert (h.double() - exact).abs().max() < 1e-4
    # the same formula in bf16 is off by far more: the reason for the upcast
    z = logits
    in_bf16 = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    assert (in_bf16.double() - exact).abs().max() > 1e-2


def test_engine_cli_defaults_to_bf16_on_cuda_and_fp32_on_cpu():
    assert default_dtype("cuda") == default_dtype("cuda:1") == torch.bfloat16
    assert default_dtype("cpu") == torch.float32


# ---- --*.fsdp.param-dtype auto on CPU: bf16 only where it was measured faster

@pytest.mark.parametrize("instructions", ["AMX", "AVX512-BF16", None])
def test_auto_compute_dtype_is_bf16_on_cpu_only_with_bf16_instructions_at_real_sizes(monkeypatch, instructions):
    from hflow.workers import fsdp

    monkeypatch.setattr(fsdp, "cpu_bf16_instructions", lambda: instructions)
    cpu = torch.device("cpu")
    assert fsdp.auto_param_dtype(torch.device("cuda", 0), 64) == torch.bfloat16
    assert fsdp.auto_param_dtype(cpu, 1024) == (torch.bfloat16 if instructions else torch.float32)   # Qwen3-0.6B
    assert fsdp.auto_param_dtype(cpu, 512) == torch.float32    # the embedded default, the tests' models
    assert fsdp.auto_param_dtype(cpu) == torch.float32         # size unknown (the library used directly)
    assert fsdp.mixed_precision(fsdp.FSDPConfig(), cpu).param_dtype == torch.float32


def test_recipes_resolve_auto_for_the_policy_and_warn_of_bf16_without_bf16_instructions(monkeypatch, tmp_path, capsys):
    import json

    from test_readme import recipe_config

    from hflow.recipe_kit.set_up import resolve_compute_dtypes
    from hflow.workers import fsdp

    def load_recipe_config(name):
        return recipe_config(name)()

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 1024}))
    monkeypatch.setattr(fsdp, "cpu_bf16_instructions", lambda: "AVX512-BF16")
    cfg = load_recipe_config("ppo")
    resolve_compute_dtypes(cfg, tmp_path, "cpu")
    assert cfg.actor.fsdp.param_dtype == cfg.critic.fsdp.param_dtype == "bfloat16"
    assert "--actor.fsdp.param-dtype auto: bfloat16 (this CPU has AVX512-BF16" in capsys.readouterr().out

    monkeypatch.setattr(fsdp, "cpu_bf16_instructions", lambda: None)
    cfg = load_recipe_config("ppo")
    resolve_compute_dtypes(cfg, tmp_path, "cpu")
    assert cfg.actor.fsdp.param_dtype == "float32" and capsys.readouterr().out == ""
    cfg = load_recipe_config("grpo")
    cfg.actor.fsdp.param_dtype = "bfloat16"   # asked for: kept, with a warning
    resolve_compute_dtypes(cfg, tmp_path, "cpu")
    assert cfg.actor.fsdp.param_dtype == "bfloat16"
    assert "warning: --actor.fsdp.param-dtype bfloat16 on a CPU without bf16 instructions" in capsys.readouterr().out
