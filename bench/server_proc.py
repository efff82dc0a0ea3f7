"""A cellserve started as a subprocess for the benchmark, stopped even when the run fails."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Polls GET /health until 200; returns the seconds it took. Raises if the process dies."""
    start = time.monotonic()
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if proc.poll() is not None:
                raise ServerStartError(f"server exited with status {proc.returncode}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            if time.monotonic() - start > timeout_s:
                raise ServerStartError(f"server not healthy after {timeout_s:.0f} s")
            time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM (cellserve drains), then SIGKILL after the grace period."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def cellserve(
    log_path: pathlib.Path, extra_args: list[str], startup_timeout_s: float = 300.0
) -> Iterator[tuple[str, float]]:
    """Starts `python -m server.cli serve` on a free port; yields (base URL, start-up seconds).

    The server's output goes to `log_path`; the process is stopped on exit, error or not.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        try:
            url = f"http://127.0.0.1:{port}"
            yield url, wait_healthy(url, proc, startup_timeout_s)
        finally:
            stop(proc)
