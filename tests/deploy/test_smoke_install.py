"""deploy/smoke_install.sh: the Dockerfile's install and start steps, outside Docker, end to end
(fresh venv, pip install, `cellserve serve`, /health, one completion, SIGTERM drain)."""

from __future__ import annotations

import os
import platform
import sys

import pytest

from tests.deploy.tooling import DEPLOY, REPO, require_tool, run


def pip_index_url() -> str:
    """The index this machine's pip uses; the CPU image's PyTorch index may be unreachable."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    result = run([sys.executable, "-m", "pip", "config", "get", "global.index-url"])
    return result.stdout.strip() if result.returncode == 0 else "https://pypi.org/simple"


@pytest.mark.slow
@pytest.mark.model
def test_smoke_install_serves_one_completion() -> None:
    bash = require_tool("bash")
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "TORCH_INDEX_URL": pip_index_url(),
        "SMOKE_TIMEOUT": "240",
        "CELLSERVE_N_CELLS": "1024",
        "CELLSERVE_DRAIN_TIMEOUT": "5",
        # `build-kernels --all` as in the image, narrowed to one level (~80 s, not ~4 min)
        "CELLSERVE_KERNEL_LEVELS": "avx2" if platform.machine() == "x86_64" else "generic",
    }
    env.pop("CELLSERVE_API_KEY", None)
    env.pop("VIRTUAL_ENV", None)
    result = run([bash, str(DEPLOY / "smoke_install.sh")], cwd=REPO, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "smoke: OK" in result.stdout
    assert "completion_tokens=" in result.stdout
