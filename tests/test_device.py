"""The device-parametrised subset: what scripts/gpu_check.sh runs with HFLOW_DEVICE=cuda on one
GPU, and the suite runs on CPU (HFLOW_DEVICE unset). The engine's tests against transformers
(tests/test_engine.py) follow HFLOW_DEVICE too; these add bf16 and the hybrid engine's weight
hand-off and log-prob parity on one rank, with the bf16 tolerance of
tests/programs/device_hybrid.py."""
import os

import pytest
import torch
from dist import PROGRAMS, device, torchrun
from test_engine import DEVICE, prompts_of, saved  # noqa: F401  (saved: a fixture)
from test_fsdp import TESTS_ENV, tiny_model_dir

from hflow.engine import LLM, SamplingParams

HYBRID = os.path.join(PROGRAMS, "device_hybrid.py")


@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_engine_hand_off_and_log_prob_parity(tmp_path, dtype):
    path = tiny_model_dir(tmp_path / "model")
    run = torchrun(HYBRID, nproc=1, args=[path, dtype], tmp_path=tmp_path, timeout=300, env=TESTS_ENV).check()
    line = next(x for x in run.output.splitlines() if x.startswith("device "))
    print(line)
    assert line.split()[1].startswith(device().split(":")[0])


# bf16 engine vs the fp32 transformers oracle. Greedy tokens of two computations that round
# differently can part at a near-tie, after which the sequences differ: so each bf16 token must
# be one the fp32 model ranks (nearly) first at that point of the bf16 sequence, and its
# log-prob must match the fp32 one of that token within BF16_LOGPROB_TOL.
# Measured on CPU bf16 (the tiny models, logits of a few units): log-prob differences up to 0.11,
# gaps up to 0.18 (qwen2), 1-4 of 4 sequences equal to fp32 generate's.
BF16_LOGPROB_TOL = 0.15
BF16_LOGIT_GAP = 0.3   # the chosen token's fp32 logit is within this of the best one


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_bf16_engine_against_fp32_transformers(saved, arch):
    path, model = saved[arch]
    llm = LLM.from_pretrained(path, device=DEVICE, dtype=torch.bfloat16)
    assert llm.model.embed_tokens.weight.dtype == torch.bfloat16
    prompts = prompts_of([3, 17, 40, 64], seed=len(arch))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    worst_lp, worst_gap, same = 0.0, 0.0, 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(logits, -1)
        chosen = torch.tensor(c.token_ids)
        worst_lp = max(worst_lp, (logp.gather(1, chosen[:, None])[:, 0] - torch.tensor(c.logprobs)).abs().max().item())
        worst_gap = max(worst_gap, (logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0]).max().item())
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        same += c.token_ids == ref
    print(f"{arch} bf16 on {DEVICE}: log-prob diff {worst_lp:.3f}, logit gap {worst_gap:.3f}, "
          f"{same}/{len(prompts)} sequences equal to fp32 generate")
    assert worst_lp <= BF16_LOGPROB_TOL
    assert worst_gap <= BF16_LOGIT_GAP
