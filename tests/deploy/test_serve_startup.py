"""`cellserve serve` start-up: it says which ISA path, kernels, dtype and quantization it runs
and why (log and /metrics); with a model it cannot load it ends at once with exit status 1 and
the one-sentence reason (a supervisor or an orchestrator then sees the failure, instead of a
process answering 503 forever)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.tooling import REPO, free_port
from tests.live_server import start_server_process
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import write_tiny_llama


def serve(model: Path, timeout: float = 90) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CELLSERVE_MODEL", None)
    cmd = [sys.executable, "-c", "from cli.main import main; raise SystemExit(main())"]
    cmd += ["serve", "--model", str(model), "--port", str(free_port()), "--n-cells", "64"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    folder = write_tiny_llama(tmp_path_factory.mktemp("hf"))
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", folder)


def test_missing_file(tmp_path):
    code, err, seconds = serve(tmp_path / "nope.gguf")
    assert code == 1, err
    assert "cannot serve the model" in err and "no such model file or folder" in err
    assert seconds < 60


def test_unsupported_architecture(tmp_path, tiny_gguf):
    folder = write_tiny_llama(tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "rwkv6.gguf", folder, arch="rwkv6")
    code, err, _ = serve(path)
    assert code == 1, err
    assert "architecture 'rwkv6' is not supported" in err


def test_truncated_gguf(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: len(data) // 2])
    code, err, _ = serve(path)
    assert code == 1, err
    last = [line for line in err.splitlines() if "cannot serve the model" in line]
    assert last and "truncated or corrupt" in last[-1], err


def test_a_loadable_copy_of_the_same_file_still_loads(tmp_path, tiny_gguf):
    """The control: the untruncated file is served (the exit above is about the file)."""
    from model import load_model

    shutil.copy(tiny_gguf, tmp_path / "ok.gguf")
    assert load_model(tmp_path / "ok.gguf").config.n_layers == 2


def test_start_up_says_what_it_runs_and_why(tmp_path):
    """A Q8_0 GGUF with no flags: served int8, activations by the CPU's bfloat16 support; the
    log names the CPU, the ISA path and the kernels; /metrics carries the same."""
    from model.kernels import isa

    folder = write_tiny_llama(tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "q8.gguf", folder, qtype="Q8_0")
    server = start_server_process("--model", str(path), "--n-cells", "64", ready_timeout=120)
    try:
        dtype = "bfloat16" if isa.native_bfloat16() else "float32"
        completion = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
        )
        assert completion.status_code == 200
        metrics = httpx.get(f"{server.url}/metrics").text
        info = next(line for line in metrics.splitlines() if line.startswith("cellserve_runtime"))
        for label in (f'isa="{isa.active_level()}"', f'dtype="{dtype}"', 'quant="int8"'):
            assert label in info, info
    finally:
        server.terminate()
        server.process.wait(timeout=60)
    log = server.output()
    assert f"ISA path {isa.active_level()}" in log and "C++ kernels:" in log
    assert f"running {dtype} activations, int8 weights: " in log
    assert "the GGUF's are Q8_0" in log
