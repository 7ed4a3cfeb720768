"""uvicorn serving an app on loopback from a thread of its own, for as long as a rollout runs.

    with LoopbackServer(app) as server:
        server.url          # http://127.0.0.1:<a free port>

The socket is bound before the thread starts (port 0: the kernel picks a free one), so the URL
is known at once and nothing races for the port; leaving the block stops the server and joins
its thread (a client still connected is cut off after `grace_s`).
"""
from __future__ import annotations

import socket
import threading
import time

import uvicorn


class LoopbackServer:
    def __init__(self, app, grace_s: float = 5.0):
        self.app, self.grace_s = app, grace_s
        self.sock = None
        self.server = None
        self.thread = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "LoopbackServer":
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=self.grace_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="hflow-endpoint")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the endpoint's server stopped as it started (see the log above)")
            if time.monotonic() > deadline:
                raise RuntimeError("the endpoint's server did not start within 30 s")
            time.sleep(0.005)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(self.grace_s + 5)
        self.sock.close()
