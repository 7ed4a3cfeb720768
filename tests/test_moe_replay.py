"""Routing replay (workers/moe_replay.py) on transformers' Qwen3-MoE: replaying the model's own
routing changes nothing, replaying other experts gives the forward written out by hand with
those experts (weights: the router's probabilities there, renormalised), the router still gets a
gradient, and the disagreement count is the number of token x layer top-k sets that differ."""
import pytest
import torch
import torch.nn.functional as F

from hflow.workers.moe_replay import NO_ROUTE, RoutingReplay, routes_in_layout
from test_qwen3_moe import hf_routed_experts, tiny_moe

TOKENS = [3, 17, 5, 99, 42, 8, 8, 61, 2, 77, 30]


def by_hand_logits(model, tokens: list[int], routes: torch.Tensor) -> torch.Tensor:
    """The model's logits with the MoE layers' experts forced to `routes` [T, moe layers, k],
    each expert's weight the router's softmax probability at it (renormalised over the k if
    norm_topk_prob): attention and dense MLPs are transformers' modules, the MoE written out."""
    cfg, base = model.config, model.model
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    x = base.embed_tokens(ids)
    cos_sin = base.rotary_emb(x, positions)
    moe = 0
    for layer in base.layers:
        h = layer.input_layernorm(x)
        x = x + layer.self_attn(h, position_embeddings=cos_sin, attention_mask=None)[0]
        h = layer.post_attention_layernorm(x)[0]
        if not hasattr(layer.mlp, "gate"):
            x = x + layer.mlp(h)[None]
            continue
        probs = F.softmax(h @ layer.mlp.gate.weight.T, -1, dtype=torch.float)
        chosen = routes[:, moe].long()
        weights = probs.gather(-1, chosen)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        experts = layer.mlp.experts
        out = torch.zeros_like(h)
        for t in range(len(tokens)):
            for slot in range(chosen.shape[1]):
                e = int(chosen[t, slot])
                gate, up = (experts.gate_up_proj[e] @ h[t]).chunk(2)
                out[t] += weights[t, slot] * (experts.down_proj[e] @ (F.silu(gate) * up))
        x = x + out[None]
        moe += 1
    return model.lm_head(base.norm(x))[0]


def other_routes(own: torch.Tensor, experts: int, seed: int = 0) -> torch.Tensor:
    """Routes that differ from `own` in about half the token x layer pairs (k distinct experts each)."""
    g = torch.Generator().manual_seed(seed)
    routes = own.clone()
    T, L, k = own.shape
    for t in range(T):
        for layer in range(L):
            if torch.rand((), generator=g) < 0.5:
                routes[t, layer] = torch.randperm(experts, generator=g)[:k].to(routes.dtype)
    return routes


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replaying_own_routing_changes_nothing(norm_topk_prob):
    model = tiny_moe(norm_topk_prob)
    replay = RoutingReplay(model)
    assert len(replay.routers) == 2
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        plain = model(ids).logits
        replay.use(hf_routed_experts(model, TOKENS).to(torch.int32), replay=True)
        replayed = model(ids).logits
    assert torch.equal(plain, replayed)
    assert replay.disagreement() == (0, 2 * len(TOKENS))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replaying_other_routes_is_the_forward_by_hand(norm_topk_prob):
    model = tiny_moe(norm_topk_prob, seed=5)
    own = hf_routed_experts(model, TOKENS)
    routes = other_routes(own, 8).to(torch.int32)
    differ = int((routes.sort(-1).values != own.sort(-1).values).any(-1).sum())
    assert differ > 3
    replay = RoutingReplay(model)
    with torch.no_grad():
        replay.use(routes, replay=True)
        replayed = model(torch.tensor([TOKENS])).logits[0]
        expected = by_hand_logits(model, TOKENS, routes)
        replay.use(None, replay=False)
        plain = model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(replayed, expected, atol=1e-5, rtol=1e-5)
    assert (replayed - plain).abs().max() > 1e-3   # the routes matter
    # only compared (replay off): the trainer's own forward, the count of differing sets
    replay.use(routes, replay=False)
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([TOKENS])).logits[0], plain)
    assert replay.disagreement() == (differ, 2 * len(TOKENS))


def test_tokens_without_a_route_keep_their_own_and_the_router_learns():
    model = tiny_moe(seed=6)
    own = hf_routed_experts(model, TOKENS)
    routes = other_routes(own, 8, seed=1).to(torch.int32)
    routes[-1] = NO_ROUTE    # the last token: the engine never forwarded it
    replay = RoutingReplay(model)
    replay.use(routes, replay=True)
    logits = model(torch.tensor([TOKENS])).logits[0]
    with torch.no_grad():
        expected = by_hand_logits(model, TOKENS, torch.cat([routes[:-1], own[-1:].to(torch.int32)]))
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    logits.logsumexp(-1).sum().backward()
    for router in replay.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert replay.disagreement()[1] == 2 * (len(TOKENS) - 1)


def test_routes_in_layout_left_pads_the_prompt_and_marks_the_last_token():
    from hflow.engine.sequence import CompletionOutput, RequestOutput
    r0 = torch.arange(2 * 3 * 1 * 2).view(6, 1, 2).int()[:4]    # prompt 2 + response 3 - 1
    r1 = torch.arange(100, 112).view(6, 1, 2).int()             # prompt 3 + response 4 - 1
    outs = [RequestOutput(0, [1, 2], [CompletionOutput(0, [5, 6, 7], [0.0] * 3, "stop", routed_experts=r0)]),
            RequestOutput(1, [1, 2, 3], [CompletionOutput(0, [5, 6, 7, 8], [0.0] * 4, "stop", routed_experts=r1)])]
    routes = routes_in_layout(outs, prompt_len=3, response_len=4)
    assert routes.shape == (2, 7, 1, 2)
    assert torch.equal(routes[0, 1:5], r0) and (routes[0, [0, 5, 6]] == NO_ROUTE).all()
    assert torch.equal(routes[1, :6], r1) and (routes[1, 6] == NO_ROUTE).all()
