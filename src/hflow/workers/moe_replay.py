"""Routing replay (R3) for a transformers MoE policy: the trainer's forward uses the experts
the engine chose when it sampled.

A MoE's top-k is discontinuous: the engine (its own kernels, its own dtype rounding) and the
trainer can pick different experts for the same token, and the log-prob gap that causes is
far larger than a dense model's numerical noise, which inflates the importance weights of
off-policy corrections (verl PR #4101, slime, SkyRL "rollout routing replay"). Replay keeps
the trainer's router in the graph: the experts are the engine's, their weights the trainer's
own router probabilities at those experts (renormalised over the k when the config's
`norm_topk_prob` says so), so the router still learns.

The engine hands out each completion's experts (CompletionOutput.routed_experts); the rollout
lays them out as `routed_experts` [B, P + R, moe layers, top_k] (int, -1 where the engine
forwarded no token: padding and each row's last token), the packed forward picks them in packed
order (Packed.sources), and the forward hooks here replace each router's choice. Whether or not
replay is on, the hooks count the tokens x layers whose top-k sets differ between engine and
trainer (`disagreement`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NO_ROUTE = -1   # a token the engine did not forward (padding, a row's last token)


@dataclass
class MoEConfig:
    """Mixture-of-experts policies (Qwen3-MoE)."""

    routing_replay: bool = False
    """the trainer's log-prob passes use the experts the rollout engine chose (R3), with the
    trainer's own router weights at those experts; needs rollouts from hflow's engine"""


def is_router(module: nn.Module) -> bool:
    """A transformers top-k router (Qwen3MoeTopKRouter and its kind): returns
    (logits, top-k weights, top-k experts) from a `weight` [E, H]."""
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers, in layer order (the engine's `moe layers` order)."""
    return [m for m in model.modules() if is_router(m)]


class RoutingReplay:
    """Forward hooks on every router of `model`. Per micro-batch, `use(routes, replay)` with
    the packed tokens' engine experts [T, moe layers, top_k] (or None: the trainer's own)."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self.routes: torch.Tensor | None = None
        self.replay = False
        self.counted: set[int] = set()
        self.differ = torch.zeros((), dtype=torch.long)
        self.compared = torch.zeros((), dtype=torch.long)
        self.totals = [0, 0]   # (differ, compared) over every forward: a caller's to read and reset
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def __bool__(self) -> bool:
        return bool(self.routers)

    def use(self, routes: torch.Tensor | None, replay: bool) -> None:
        """The routes of the next forward (kept for a recomputing backward, as activation
        checkpointing runs the layers again); `replay` False only compares."""
        if routes is not None and routes.shape[1] != len(self.routers):
            raise ValueError(f"routed_experts has {routes.shape[1]} MoE layers, the model {len(self.routers)}")
        self.routes, self.replay, self.counted = routes, replay, set()
        self.disagreement()   # counts are per forward

    def disagreement(self, reset: bool = True) -> tuple[int, int]:
        """(token x layer pairs whose top-k sets differed, pairs compared) in the last forward."""
        out = int(self.differ), int(self.compared)
        if reset:
            self.differ.zero_()
            self.compared.zero_()
        return out

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self.routes is None:
                return output
            logits, weights, chosen = output
            engine = self.routes[:, layer].to(device=chosen.device, dtype=chosen.dtype)
            known = (engine != NO_ROUTE).all(-1)
            if layer not in self.counted:   # a recomputing backward is not a second look
                self.counted.add(layer)
                same = (engine.sort(-1).values == chosen.sort(-1).values).all(-1)
                differ, compared = (known & ~same).sum().cpu(), known.sum().cpu()
                self.differ += differ
                self.compared += compared
                self.totals[0] += int(differ)
                self.totals[1] += int(compared)
            if not self.replay:
                return output
            experts = torch.where(known[:, None], engine, chosen)
            probs = F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
            if module.norm_topk_prob:
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(weights.dtype), experts
        return hook


def routes_in_layout(outputs, prompt_len: int, response_len: int) -> torch.Tensor | None:
    """The engine's experts of each sample (RequestOutput.outputs' routed_experts, row per
    sample in order) in the layout [B, P + R, moe layers, top_k]: the prompt left-padded as
    input_ids, NO_ROUTE on padding and on each row's last token. None when the engine gave none."""
    samples = [(len(o.prompt_token_ids), s.routed_experts) for o in outputs for s in o.outputs]
    if not samples or samples[0][1] is None:
        return None
    layers, k = samples[0][1].shape[1:]
    routes = torch.full((len(samples), prompt_len + response_len, layers, k), NO_ROUTE, dtype=torch.int32)
    for row, (p, r) in enumerate(samples):
        start = prompt_len - p
        routes[row, start:start + len(r)] = r
    return routes


def packed_routes(tensors: dict[str, torch.Tensor], sources: torch.Tensor) -> torch.Tensor | None:
    """The packed tokens' routes ([T, moe layers, top_k]) from the batch's `routed_experts`."""
    routes = tensors.get("routed_experts")
    if routes is None:
        return None
    return routes.flatten(0, 1).index_select(0, sources.to(routes.device))
