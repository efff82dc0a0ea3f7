"""Start a real cellserve (uvicorn) for tests: in a thread, or as a `cellserve serve` process.

server = start_server(n_cells=2048, ctx_per_seq=512)       # the real model
server = start_server(backend_factory=my_factory, api_key="k")
... httpx / openai against server.url ...
server.stop()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import uvicorn

from server.app import create_app
from server.backend import BackendFactory
from server.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LiveServer:
    url: str
    settings: Settings
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def _bound_socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock


def wait_ready(url: str, timeout: float, is_alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_alive():
            raise RuntimeError(f"the server at {url} stopped before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health not ready after {timeout} s")


def start_server(
    backend_factory: BackendFactory | None = None,
    *,
    ready_timeout: float = 300,
    wait: bool = True,
    **settings,
) -> LiveServer:
    """uvicorn in a daemon thread on a free port; returns once /health is 200 (or at once
    when `wait` is False: then the caller sees the loading phase)."""
    sock = _bound_socket("127.0.0.1")
    port = sock.getsockname()[1]
    s = Settings(host="127.0.0.1", port=port, **settings)
    app = create_app(s, backend_factory)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(s.url, s, app, server, thread)
    if not wait:
        return live
    try:
        # a failed load keeps the thread serving 503: stop waiting once the app says so
        wait_ready(
            live.url,
            ready_timeout,
            lambda: thread.is_alive() and not getattr(app.state, "load_error", None),
        )
    except Exception:
        live.stop()
        if app.state.load_error:
            raise RuntimeError(app.state.load_error) from None
        raise
    return live


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen
    log: IO[bytes]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait(timeout=30)


def start_server_process(*args: str, ready_timeout: float = 300) -> ServerProcess:
    """`python -m cli serve --port <free> ARGS` as a child process."""
    sock = _bound_socket("127.0.0.1")
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "cli", "serve", "--port", str(port), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the ServerProcess)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    sp = ServerProcess(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_ready(sp.url, ready_timeout, lambda: proc.poll() is None)
    except Exception:
        sp.stop()
        raise
    return sp
