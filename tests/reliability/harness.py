"""A real `cellserve serve` subprocess for the reliability tests, and small HTTP helpers.

A subprocess (not an in-process app) because these tests need its RSS, its log output, its
environment (the test-only fault hooks) and a process that may lose its engine thread.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.live_server import wait_ready

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO_ROOT / "tests" / "artifacts"
START_TIMEOUT = 180.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """`cellserve serve` with the given flags; stdout and stderr go to one log file."""

    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)
    entry: str = "cli.main"  # module whose main() runs; tests.reliability.faults injects faults
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ServerProcess:
        self.port = free_port()
        fd, name = tempfile.mkstemp(prefix="cellserve-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        argv = [sys.executable, "-c", f"from {self.entry} import main; main()", "serve"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *self.flags]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CELLSERVE_")}
        env.update(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        try:
            wait_ready(self.url, START_TIMEOUT, self.alive)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}:\n{self.log()}") from exc

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def rss_bytes(self) -> int:
        return psutil.Process(self.pid).memory_info().rss

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels verbatim; '' when none)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def metric(samples: dict[str, float], name: str) -> float:
    """The value of an unlabelled sample, or the sum over every labelled sample of `name`."""
    if name in samples:
        return samples[name]
    hits = [v for k, v in samples.items() if k.startswith(name + "{")]
    if not hits:
        raise KeyError(f"no metric {name!r}; have: {sorted(samples)[:80]}")
    return sum(hits)


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    resp = httpx.get(f"{url}/metrics", headers=headers, timeout=10.0)
    resp.raise_for_status()
    return parse_metrics(resp.text)


def assert_openai_error(resp: httpx.Response, status: int, *words: str) -> dict:
    """The response has `status` and OpenAI's error shape, and its message names `words`."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"], err
    for word in words:
        assert word.lower() in err["message"].lower(), (word, err)
    return err


def assert_api_error(resp: httpx.Response, path: str, status: int, *words: str) -> dict:
    """assert_openai_error, or Anthropic's shape under /v1/messages (server/errors.py)."""
    if not path.startswith("/v1/messages"):
        return assert_openai_error(resp, status, *words)
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    err = body["error"]
    assert set(err) == {"type", "message"} and err["message"], err
    for word in words:
        assert word.lower() in err["message"].lower(), (word, err)
    return err


def record(name: str, values: dict) -> None:
    """Keep measured numbers in tests/artifacts/reliability.json (ignored by git): the table
    of docs/reliability.md is filled from it."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "reliability.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = values
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
