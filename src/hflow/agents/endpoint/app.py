"""The HTTP side: an ASGI app (Starlette) whose routes hand each request to the engine's thread
and wait for its answer there. A session is named in the path, so that an agent needs nothing but
a base_url (`http://127.0.0.1:PORT/sessions/<id>/v1`) and the official client:

    POST /sessions/<id>/v1/chat/completions   messages (and tools) in, an assistant message out
    POST /sessions/<id>/v1/completions        token ids (or text) in, tokens out: token-in/token-out
    POST /sessions/<id>/v1/tokenize           text in, its token ids out (as text: no control tokens),
                                              for a token-in/token-out agent's observations
    GET  /sessions/<id>/v1/models             the one model, "hflow"
    GET  /health

No session state lives here: `submit(session_id, route, body)` returns a concurrent Future of
(status, body), resolved by whoever drives the engine (workers/agent_endpoint.py).
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future
from typing import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hflow.agents.endpoint.openai_format import error_body, stream_chunks

Submit = Callable[[str, str, dict], Future]


def build_app(submit: Submit) -> Starlette:
    async def completions(request: Request, route: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse(error_body("the request body is not JSON", "invalid_json"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the request body is not a JSON object", "invalid_json"), status_code=400)
        stream, options = body.pop("stream", False), body.pop("stream_options", None) or {}
        status, payload = await asyncio.wrap_future(submit(request.path_params["session"], route, body))
        if status != 200 or not stream:
            return JSONResponse(payload, status_code=status)
        # streamed: the whole turn, which the engine has finished, as server-sent events
        events = [f"data: {json.dumps(c)}\n\n" for c in stream_chunks(payload, bool(options.get("include_usage")))]
        return StreamingResponse(iter(events + ["data: [DONE]\n\n"]), media_type="text/event-stream")

    async def chat(request: Request) -> JSONResponse:
        return await completions(request, "chat")

    async def text(request: Request) -> JSONResponse:
        return await completions(request, "completion")

    async def tokenize(request: Request) -> JSONResponse:
        return await completions(request, "tokenize")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "hflow", "object": "model", "owned_by": "hflow"}]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[
        Route("/sessions/{session}/v1/chat/completions", chat, methods=["POST"]),
        Route("/sessions/{session}/v1/completions", text, methods=["POST"]),
        Route("/sessions/{session}/v1/models", models, methods=["GET"]),
        Route("/sessions/{session}/v1/tokenize", tokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ])
