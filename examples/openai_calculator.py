"""An agent of your own, written against the official openai client, trained by hflow as it is.

    torchrun --nproc-per-node 2 recipes/agent.py --agent.env examples/openai_calculator.py:solve

hflow calls `solve(row, base_url)` once per trajectory during each rollout; base_url is the
trajectory's own session on an OpenAI-compatible endpoint hflow serves from its engine on
loopback, and every request made through it is one turn of that trajectory, recorded token for
token (hflow.agents.endpoint). What `solve` returns is the trajectory's reward.

This one plays the embedded default's calculator task, as recipes/agent.py's built-in
`calculator` environment does: the model writes `<calc>127*46</calc>`, the agent computes it and
shows `<result>5842</result>`, until the model answers without a call. The default model writes
plain text, not a chat template's turns, so the agent speaks token ids (the /v1/completions
route: token-in/token-out) and has the endpoint's /v1/tokenize turn each result into the tokens
that stand for it. A model with a chat template would use client.chat.completions.create with
messages and tools= instead; hflow records those turns the same way.
"""
from __future__ import annotations

import re

import openai

from hflow.agents.builtin_tools import calculator
from hflow.agents.tools import ToolInputError
from hflow.rewards.arithmetic import arithmetic_score

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_TURNS = 8
# one client for every trajectory of the rollout, copied with each one's base_url: a new client
# builds its own connection pool and TLS context, ~40 ms of CPU each
_client = None


def client_for(base_url: str) -> openai.OpenAI:
    global _client
    if _client is None:
        _client = openai.OpenAI(base_url=base_url, api_key="hflow", max_retries=0)
    return _client.with_options(base_url=base_url)


def solve(row: dict, base_url: str) -> dict:
    client = client_for(base_url)
    ids, calls = list(row["prompt_ids"]), 0
    for _ in range(MAX_TURNS):
        reply = client.completions.create(model="hflow", prompt=ids)
        choice = reply.choices[0]
        # the stream so far: what the engine was given and what it sampled (hflow's extra fields)
        ids = reply.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
        asked = CALL.findall(choice.text)
        if not asked or choice.finish_reason != "stop":
            return {"reward": arithmetic_score(choice.text, row["answer"]), "tool_calls": calls}
        results = []
        for expression in asked:
            calls += 1
            try:
                results.append(f"<result>{calculator(expression)}</result>")
            except ToolInputError as e:
                results.append(f"<result>error: {e}</result>")
        ids += client.post("/tokenize", body={"prompt": "".join(results)}, cast_to=object)["tokens"]
    return {"reward": 0.0, "tool_calls": calls}
