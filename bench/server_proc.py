"""Servers started as subprocesses for the benchmark, stopped even when the run fails.

`cellserve(...)` starts this repository's server; `llama_server(...)` starts llama.cpp's
`llama-server` on the same GGUF, for a side-by-side run of the same workload.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from model.kernels.isa import cpu_flags

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
LLAMACPP_DEFAULT = (
    pathlib.Path.home() / ".cache" / "cellserve" / "llama.cpp" / "bin" / "llama-server"
)


def llamacpp_default(isa: str | None = None) -> pathlib.Path:
    """Where bench/build_llamacpp.sh installs llama-server: native, or built for one ISA level
    (LLAMA_ISA=<level>, the same names as CELLSERVE_ISA)."""
    if isa is None:
        return LLAMACPP_DEFAULT
    return LLAMACPP_DEFAULT.parents[2] / f"llama.cpp-{isa}" / "bin" / "llama-server"


class ServerStartError(RuntimeError):
    pass


@dataclass(slots=True)
class Served:
    url: str
    startup_s: float
    command: list[str]
    pid: int = 0

    def rss_bytes(self) -> int | None:
        """The server process's resident memory now (Linux /proc; None elsewhere)."""
        return self._status_bytes("VmRSS:")

    def peak_rss_bytes(self) -> int | None:
        """The most it was resident at any moment so far (the high-water mark): after a load,
        the KV pages and state slots it touched, which right after start may not be yet."""
        return self._status_bytes("VmHWM:")

    def _status_bytes(self, field: str) -> int | None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith(field):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


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
    """SIGTERM (both servers drain or exit on it), then SIGKILL after the grace period."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def served(
    command_for: Callable[[int], list[str]], log_path: pathlib.Path, startup_timeout_s: float
) -> Iterator[Served]:
    """Runs `command_for(free port)` until /health is 200; stops it on exit, error or not.

    The command line and then the server's output go to `log_path`.
    """
    port = free_port()
    cmd = command_for(port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **llamacpp_env(pathlib.Path(cmd[0]))}
    with log_path.open("wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        try:
            url = f"http://127.0.0.1:{port}"
            yield Served(url, wait_healthy(url, proc, startup_timeout_s), cmd, proc.pid)
        finally:
            stop(proc)


def cellserve_command(port: int, extra_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "cli", "serve", "--port", str(port), *extra_args]


@contextmanager
def cellserve_process(
    log_path: pathlib.Path, extra_args: list[str], startup_timeout_s: float = 300.0
) -> Iterator[Served]:
    """Starts `python -m cli serve` on a free port."""
    with served(lambda port: cellserve_command(port, extra_args), log_path, startup_timeout_s) as s:
        yield s


@contextmanager
def cellserve(
    log_path: pathlib.Path, extra_args: list[str], startup_timeout_s: float = 300.0
) -> Iterator[tuple[str, float]]:
    """`cellserve_process` that yields (base URL, start-up seconds)."""
    with cellserve_process(log_path, extra_args, startup_timeout_s) as s:
        yield s.url, s.startup_s


def llamacpp_env(binary: pathlib.Path) -> dict[str, str]:
    """What llama.cpp's server `binary` needs in its environment on this CPU: on a CPU with AMX
    its native build crashed right after loading any model (SIGSEGV in its warm-up; 2-core Xeon
    VM, 2026-12-06, llama.cpp from llama-cpp-python 0.3.36) unless its weight repacking, and with
    it its AMX buffers, was off, so LLAMA_ARG_REPACK=0 there (`--no-repack`). A build without
    AMX (bench/build_llamacpp.sh's LLAMA_ISA builds: -DGGML_AMX_INT8=OFF in the BUILD_INFO
    beside its bin/) ran with repacking on that CPU and keeps it: repacking is llama.cpp's
    default and faster. A value the caller set wins."""
    if "LLAMA_ARG_REPACK" in os.environ or "amx_int8" not in cpu_flags():
        return {}
    try:
        info = (binary.resolve().parents[1] / "BUILD_INFO").read_text()
    except (OSError, IndexError):
        info = ""
    if "-DGGML_AMX_INT8=OFF" in info:
        return {}
    return {"LLAMA_ARG_REPACK": "0"}


def llamacpp_command(
    binary: pathlib.Path, model_path: pathlib.Path, port: int, n_threads: int, n_ctx: int = 32768
) -> list[str]:
    """llama-server with 32 slots sharing `n_ctx` cells: the same shape as cellserve's cache."""
    return [
        str(binary), "-m", str(model_path), "-t", str(n_threads), "-c", str(n_ctx), "-np", "32",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


@contextmanager
def llama_server(
    binary: pathlib.Path,
    model_path: pathlib.Path,
    log_path: pathlib.Path,
    n_threads: int,
    startup_timeout_s: float = 120.0,
    n_ctx: int = 32768,
) -> Iterator[Served]:
    """Starts llama.cpp's `llama-server` with `n_ctx` cells (cellserve's --n-cells); raises
    ServerStartError if `binary` cannot run."""
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise ServerStartError(f"{binary} is not an executable file")

    def command_for(port: int) -> list[str]:
        return llamacpp_command(binary, model_path, port, n_threads, n_ctx)

    with served(command_for, log_path, startup_timeout_s) as s:
        yield s
