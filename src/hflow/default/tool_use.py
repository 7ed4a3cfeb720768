"""The agent task's starting policy: the warmed-up default taught that a calculator exists.

On the multiply task (hflow.data: "127*46=" -> "5842") the embedded default cannot work out the
product in its head. Supervised on a mix of two kinds of target, it learns both behaviours and
keeps them apart only by chance, as an SFT model that has seen a few tool calls would (STAGES):

    127*46=<calc>127*46</calc><|im_end|><result>5842</result>5842<|im_end|>   (a `tool_rate` share)
    127*46=5842<|im_end|>                                                    (the rest)

The tool result is an observation (response_mask 0): it is read, never trained on, so the
model learns to call the tool and copy its answer, not to predict the answer inside the tags.
The streams are built with the same renderer and tool the agent rollout uses, so their tokens
are the ones a rollout of this policy produces. RL (recipes/agent.py) then has something to
find: a trajectory that calls the tool is right, one that answers directly almost never is.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hflow.runtime import stopping
from hflow.agents import Segment, TextRenderer, Trajectory, trajectory_tensors
from hflow.agents.builtin_tools import calculator
from hflow.agents.tools import as_tool
from hflow.algos import nll_loss
from hflow import layout
from hflow.batch import Batch
from hflow.data import PromptSampler
from hflow.default.cache import build_once
from hflow.metrics import progress
from hflow.workers import Actor, ActorConfig, OptimConfig

# Bump when tool_calling_policy's settings change what it builds: its cache directory carries it.
TOOL_POLICY_VERSION = 1
CALC_TAG = as_tool(calculator).tag   # once: as_tool reads the function's signature and docstring


def tool_trajectory(prompt, tokenizer, renderer: TextRenderer, use_tool: bool) -> Trajectory:
    """The stream the policy is taught for one problem: a calculator call, its result (an
    observation) and the copied answer; or the answer straight away."""
    eos = tokenizer.eos_token_id
    answer = renderer.encode(str(prompt.ground_truth)) + [eos]
    t = Trajectory(list(prompt.prompt_ids))
    if use_tool:
        expression = prompt.prompt.removesuffix("=")
        call = renderer.encode(f"<{CALC_TAG}>{expression}</{CALC_TAG}>") + [eos]
        result = renderer.observation_ids([{"role": "tool", "content": calculator(expression)}])
        t.segments += [Segment(call, [0.0] * len(call)), Segment(result, None)]
    t.segments.append(Segment(answer, [0.0] * len(answer)))
    return t


# (share of targets that call the tool, steps): first enough calls that copying the operands in
# and the result out is learnt exactly (at a share of 0.25 for 400 steps it is not: the copies
# are off by a digit), then a short stretch of mostly direct answers that makes calls rare
# again (greedy: none; sampled: a few in a hundred) without unlearning them.
STAGES = ((0.5, 300), (0.1, 50))


def tool_calling_policy(cluster, policy_dir: str, train, tokenizer, stages=STAGES, lr: float = 1e-3,
                        batch_size: int = 128) -> str:
    """The warmed-up policy after supervised steps on the multiply task's training rows, in
    `stages` of (tool_rate, steps): a random `tool_rate` of each step's targets call the
    calculator (module docstring). Each stage is built once and cached next to the warm-up."""
    for tool_rate, steps in stages:
        policy_dir = teach_the_tool(cluster, policy_dir, train, tokenizer, tool_rate, steps, lr, batch_size)
    return policy_dir


def teach_the_tool(cluster, policy_dir: str, train, tokenizer, tool_rate: float, steps: int, lr: float,
                   batch_size: int) -> str:
    final = Path(policy_dir).with_name(f"{Path(policy_dir).name}-tools{tool_rate:g}-s{steps}-v{TOOL_POLICY_VERSION}")

    def build(out: Path) -> None:
        optim = OptimConfig(lr=lr, grad_clip=0.0)
        actor = cluster.spawn(Actor, ActorConfig(model_path=policy_dir, optim=optim, micro_batch_size=batch_size))
        print(f"teaching the warmed-up default its calculator: {steps} steps in which {tool_rate:.0%} of products "
              f"call it (once; cached in {final})", flush=True)
        renderer = TextRenderer(tokenizer)
        pad = layout.pad_id(tokenizer)
        sampler = PromptSampler(train, batch_size, shuffle=True, seed=1)
        generator = torch.Generator().manual_seed(0)
        bar = progress(total=steps, desc="tool sft")
        for step in range(1, steps + 1):
            stopping.stop_if_asked(f"while teaching the default its calculator (step {step} of {steps}; this "
                                   "stage is taught again next time)")
            rows = next(sampler)
            use_tool = (torch.rand(len(rows), generator=generator) < tool_rate).tolist()
            streams = [tool_trajectory(p, tokenizer, renderer, u) for p, u in zip(rows, use_tool)]
            metrics = actor.update(Batch(trajectory_tensors(streams, pad), meta={"n": 1}), nll_loss)[0]
            bar.update(1)
            if step % 50 == 0 or step == steps:
                print(f"tool sft step {step}: loss {metrics['actor/loss']:.4f}", flush=True)
        bar.close()
        actor.export_hf(str(out), policy_dir)
        actor.close()

    return str(build_once(final, build))
