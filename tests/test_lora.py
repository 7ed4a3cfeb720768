"""LoRA (hflow.lora): adapters on real FSDP2 ranks, the merged weights in the engine, adapter-only
checkpoints, and exports that transformers and PEFT load to the same policy."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from dist import PROGRAMS, torchrun
from hflow.lora import LoRAConfig, add_adapters, merge_state_dict, peft_adapter_files
from test_fsdp import TESTS_ENV, tiny_model_dir

LORA_ACTOR = os.path.join(PROGRAMS, "lora_actor.py")


def hf_log_probs(model, batch):
    """transformers' own forward on the padded batch: log-probs of the response tokens."""
    mask = batch["response_mask"]
    P = batch["input_ids"].shape[1] - mask.shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, batch["responses"][..., None])[..., 0]
    return logp * mask


@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_actor_trains_adapters_only_and_hands_the_engine_merged_weights(tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    torchrun(LORA_ACTOR, nproc=2, args=[path, out, dtype], tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    saved = json.loads((out / "saved.json").read_text())
    state = saved["state"]
    # 2 layers x 7 projections x (A, B): trained, and the only parameters the optimizer holds
    assert len(state["trained"]) == 28 and all(".lora_" in n for n in state["trained"])
    assert state["optimized"] == state["trained"]
    assert state["dtypes"] == [f"torch.{dtype}"] and state["adapter_dtypes"] == ["torch.float32"]
    assert saved["start_gap"] == 0.0            # B = 0: the adapted policy starts as the base
    assert saved["moved_from_base"] > 1e-2      # and the updates moved it
    # the engine holds W + (alpha / r) B A exactly as it was computed, sliced for tensor parallelism
    assert saved["engine_vs_merged"] < (1e-6 if dtype == "float32" else 1e-2)
    assert saved["engine_vs_trainer"] < (1e-4 if dtype == "float32" else 0.1)
    # the checkpoint holds the adapters, their optimizer state and the schedule; no base weight
    tensors = FileSystemReader(str(out / "ckpt")).read_metadata().state_dict_metadata
    weights = [k for k in tensors if k.startswith("model.model.") and not k.startswith("model.optimizer")]
    assert weights and all(".lora_" in k for k in weights), weights[:4]
    assert saved["resumed_gap"] == 0.0
    if dtype != "float32":
        return
    # the export is a plain model with the adapters merged: transformers computes the trained policy
    batch = torch.load(out / "batch.pt")
    merged = AutoModelForCausalLM.from_pretrained(out / "actor_hf", attn_implementation="eager", dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(hf_log_probs(merged, batch["batch"]), batch["trained"], rtol=0, atol=1e-4)
    # ... and the PEFT adapter directory on the base is the same policy
    peft = pytest.importorskip("peft")
    base = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out / "actor_hf_lora")
    torch.testing.assert_close(hf_log_probs(adapted, batch["batch"]), batch["trained"], rtol=0, atol=1e-4)


def test_merged_weights_and_peft_names_by_hand():
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [-1.0]])   # r = 1, in 2, out 2
    state = {"m.q_proj.weight": torch.eye(2), "m.q_proj.lora_A": a, "m.q_proj.lora_B": b, "m.norm.weight": torch.ones(2)}
    merged = merge_state_dict(state, scaling=0.5)
    assert set(merged) == {"m.q_proj.weight", "m.norm.weight"}
    torch.testing.assert_close(merged["m.q_proj.weight"], torch.tensor([[2.5, 3.0], [-0.5, 0.0]]))
    config, tensors = peft_adapter_files(state, LoRAConfig(rank=1, alpha=0.5, targets=("q_proj",)), "base")
    assert set(tensors) == {"base_model.model.m.q_proj.lora_A.weight", "base_model.model.m.q_proj.lora_B.weight"}
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (1, 0.5, ["q_proj"])


def test_targets_that_name_no_layer_are_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path / "model"))
    with pytest.raises(ValueError, match="--actor.lora.targets qkv: no linear layer"):
        add_adapters(model, LoRAConfig(rank=2, targets=("qkv",)))
    adapted = add_adapters(model, LoRAConfig(rank=2, targets=("q_proj", "down_proj")))
    assert len(adapted) == 4 and all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())


def test_the_peft_adapter_file_is_what_peft_expects(tmp_path):
    """Names and shapes PEFT's own LoRA model has for the same config (skipped without peft)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(tmp_path / "model")
    cfg = LoRAConfig(rank=4, alpha=8.0)
    ours = AutoModelForCausalLM.from_pretrained(path)
    add_adapters(ours, cfg)
    _, tensors = peft_adapter_files(dict(ours.named_parameters()), cfg, path)
    theirs = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                                 peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=list(cfg.targets)))
    expected = {k.replace(".default", ""): tuple(v.shape) for k, v in theirs.named_parameters() if "lora_" in k}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    save = tmp_path / "adapter"
    theirs.save_pretrained(save)
    assert set(load_file(save / "adapter_model.safetensors")) == set(tensors)
