"""An OpenAI-compatible endpoint over hflow's engine, for agents that already exist (issue 45).

An agent written against the official `openai` client trains as it is: hflow calls it with a
base_url of its own session, serves its requests from the engine during the rollout, and records
the session as one growing token stream, the same Trajectory hflow.agents builds for an
Environment (the engine's sampled ids and log-probs; the client's tool results and replies as
the chat template's delta; a mask that trains only the model's tokens).

    agent_function.py  the user's function: solve(row, base_url) -> reward (sync or async)
    openai_format.py   the wire format: messages in, assistant messages (tool calls) out, refusals
    conversation.py    EndpointSession: one session's recording, and the rule for a broken prefix
    app.py             the ASGI app (Starlette): chat completions, token-in/token-out completions
    server.py          LoopbackServer: uvicorn on 127.0.0.1, on a thread, for one rollout

The engine side is hflow.workers.agent_endpoint (serve_parts, which agent_rollout.sample_agent runs
for an agent function). Needs the `serve` extra
(openai, uvicorn, starlette).
"""
