"""Qwen3-MoE in the engine (engine/models/qwen3_moe.py): greedy tokens and log-probs equal
transformers' own model, both weight formats load, tensor parallel 2 equals 1, and the
experts it records are the ones transformers' router picks."""
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from dist import torchrun
from hflow.engine import LLM, SamplingParams


def tiny_moe(norm_topk_prob: bool = True, seed: int = 0) -> Qwen3MoeForCausalLM:
    """8 experts, top 2; layer 1 dense (mlp_only_layers), layers 0 and 2 sparse."""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
                         mlp_only_layers=[1], max_position_embeddings=256, eos_token_id=None,
                         tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():   # a router far from uniform, so top-k is not decided by rounding
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)
    return model


PROMPTS = [[5, 9, 11], list(range(3, 40)), [7] * 17]


def hf_greedy(model, prompt, max_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_greedy_and_log_probs_equal_transformers(tmp_path, norm_topk_prob):
    model = tiny_moe(norm_topk_prob)
    model.save_pretrained(tmp_path)   # per-expert tensors on disk
    llm = LLM.from_pretrained(str(tmp_path), num_kv_blocks=64, block_size=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(model, prompt, 12)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), expected, atol=1e-5, rtol=0)


def test_fused_state_dict_loads_like_the_checkpoint(tmp_path):
    """The in-memory (fused) parameters, as a weight sync sends them, give the same engine."""
    model = tiny_moe(seed=1)
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    model.save_pretrained(tmp_path)
    from_disk = LLM.from_pretrained(str(tmp_path), num_kv_blocks=64)
    fused = LLM(model.config, num_kv_blocks=64)
    loaded = fused.load_weights(model.state_dict().items())
    assert "model.layers.2.mlp.experts.down_proj" in loaded
    for (name, a), b in zip(from_disk.model.named_parameters(), fused.model.parameters()):
        assert torch.equal(a, b), name


def test_wrong_expert_shape_is_refused():
    model = tiny_moe()
    llm = LLM(model.config, num_kv_blocks=16)
    with pytest.raises(ValueError, match="experts.gate_up_proj"):
        llm.load_weights([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 30, 32))])


SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from hflow.engine import LLM, SamplingParams

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, path = dist.get_rank(), sys.argv[1]
prompts = [[5, 9, 11], list(range(3, 40)), [7] * 17]
greedy = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
sampled = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)

def run(llm):
    g = llm.generate(prompts, greedy)
    s = llm.generate(prompts, sampled)
    return ([[(c.token_ids, c.logprobs) for c in o.outputs] for o in g], [[c.token_ids for c in o.outputs] for o in s])

def same(a, b):
    (ga, sa), (gb, sb) = a, b
    assert sa == sb, (sa, sb)
    for ra, rb in zip(ga, gb):
        for (ta, la), (tb, lb) in zip(ra, rb):
            assert ta == tb, (ta, tb)
            assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4

reference = run(LLM.from_pretrained(path, num_kv_blocks=64))
tp = LLM.from_pretrained(path, tp_group=dist.group.WORLD, num_kv_blocks=64)
assert tp.model.layers[0].mlp.gate_up.shape == (8, 2, 8, 32)
same(run(tp), reference)
# fused full tensors (a weight sync) sliced by the engine
model = AutoModelForCausalLM.from_pretrained(path)
fused = LLM(model.config, tp_group=dist.group.WORLD, num_kv_blocks=64)
fused.load_weights(model.state_dict().items())
same(run(fused), reference)
print(f"rank {rank} ok", flush=True)
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.dist
def test_tp2_equals_tp1(tmp_path):
    path = tmp_path / "moe"
    tiny_moe().save_pretrained(str(path))
    run = torchrun(SCRIPT, nproc=2, args=[path], tmp_path=tmp_path, timeout=300).check()
    assert "rank 0 ok" in run.output and "rank 1 ok" in run.output, run.output


def hf_routed_experts(model, tokens: list[int]) -> torch.Tensor:
    """transformers' top-k experts of every token, [tokens, moe layers, k], sorted within k."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.float().softmax(-1).topk(k, -1).indices for logits in out.router_logits], 1)


def test_routed_experts_are_transformers_routing_prefix_cache_included(tmp_path):
    """Every sample's routing (prompt and completion but the last token) is the router's on its
    own sequence: the leader's computed prompt, the followers' shared (prefix-cached or copied)
    blocks, and a second request whose prompt comes from the prefix cache."""
    model = tiny_moe(seed=2)
    model.save_pretrained(tmp_path)
    llm = LLM.from_pretrained(str(tmp_path), num_kv_blocks=64, block_size=4)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=9, seed=5, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    again = llm.generate([PROMPTS[1]], SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=6, ignore_eos=True))
    assert again[0].num_cached_tokens > 0
    for out in first + again:
        for sample in out.outputs:
            tokens = out.prompt_token_ids + sample.token_ids
            routed = sample.routed_experts
            assert routed.shape == (len(tokens) - 1, 2, 2) and routed.dtype == torch.int32
            expected = hf_routed_experts(model, tokens[:-1])
            assert torch.equal(routed.sort(-1).values, expected.sort(-1).values)


def test_dense_model_has_no_routing(tmp_path):
    from test_engine import tiny_model
    tiny_model("qwen3").save_pretrained(tmp_path)
    out = LLM.from_pretrained(str(tmp_path), num_kv_blocks=16).generate([[3, 4, 5]], SamplingParams(max_tokens=3))
    assert out[0].outputs[0].routed_experts is None


def test_new_weights_mid_generation_recompute_the_routing(tmp_path):
    """Weights loaded between steps preempt and recompute every running sequence: the routing
    handed out is then the new model's, on every token (none left from the old weights)."""
    old, new = tiny_moe(seed=3), tiny_moe(seed=4)
    old.save_pretrained(tmp_path)
    llm = LLM.from_pretrained(str(tmp_path), num_kv_blocks=64, block_size=4)
    steps = []

    def swap():
        steps.append(1)
        if len(steps) == 3:
            llm.load_weights(new.state_dict().items())
    outs = llm.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1, ignore_eos=True),
                        between_steps=swap)
    for out in outs:
        for sample in out.outputs:
            assert sample.weight_changes == [3]
            tokens = out.prompt_token_ids + sample.token_ids
            expected = hf_routed_experts(new, tokens[:-1])
            assert torch.equal(sample.routed_experts.sort(-1).values, expected.sort(-1).values)


def test_kv_budget_counts_the_routing_beside_the_cache():
    model = tiny_moe()
    llm = LLM(model.config, kv_cache_bytes=1 << 20, block_size=8)
    kv = 2 * 3 * 8 * 2 * 8 * 4            # K and V, 3 layers, 8 slots, 2 KV heads x 8, fp32
    routing = 8 * 2 * 2 * 4               # 8 slots x 2 MoE layers x top-2, int32
    assert llm.runner.bytes_per_block(llm.model, 8) == kv + routing
    assert llm.block_manager.num_blocks == (1 << 20) // (kv + routing)
