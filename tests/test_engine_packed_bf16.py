"""The engine's packed bf16 weights (oneDNN, where the CPU has bf16 instructions): what the
engine samples and its log-probs are those of its plain bf16 matmuls, and of transformers' bf16
forward, within bf16's rounding."""
import pytest
import torch

import hflow.engine.model_runner as model_runner
from hflow.engine import LLM, SamplingParams
from hflow.engine.models.layers import can_pack
from test_engine import prompts_of, tiny_model

pytestmark = pytest.mark.skipif(not can_pack(torch.empty(1, dtype=torch.bfloat16)),
                                reason="no bf16 instructions (AMX, AVX512-BF16) for oneDNN's packed bf16 matmul")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_packed_bf16_weights_give_what_the_plain_bf16_matmuls_give(arch, monkeypatch):
    model = tiny_model(arch).to(torch.bfloat16)
    prompts = prompts_of(range(1, 40, 3), seed=3)
    params = SamplingParams(temperature=0, max_tokens=12)

    def run(pack: bool):
        monkeypatch.setattr(model_runner, "PACK_MIN_STEPS", 1 if pack else 10**9)
        llm = LLM(model.config, dtype=torch.bfloat16)
        llm.load_weights(model.state_dict().items())
        outs = llm.generate(prompts, params)
        assert llm.runner.packed == pack and (llm.model.layers[0].mlp.down_proj.packed is not None) == pack
        return outs

    plain, packed = run(False), run(True)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, packed))
    assert same >= len(prompts) - 1, same   # greedy: at most a near-tie decided the other way in bf16
    for a, b in zip(plain, packed):
        if a.outputs[0].token_ids == b.outputs[0].token_ids:
            gap = (torch.tensor(a.outputs[0].logprobs) - torch.tensor(b.outputs[0].logprobs)).abs().max()
            assert gap < 0.05, gap
    # and the engine's packed bf16 log-probs are transformers' bf16 forward's, to bf16's rounding
    for prompt, out in zip(prompts, packed):
        ids = torch.tensor([prompt + out.outputs[0].token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
        assert (ref - torch.tensor(out.outputs[0].logprobs)).abs().max() < 0.1
