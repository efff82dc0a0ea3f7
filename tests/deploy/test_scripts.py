"""The deploy shell scripts: shellcheck, and .ci/system-deps.sh is a no-op once its packages are
installed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.deploy.tooling import DEPLOY, REPO, require_tool, run

SCRIPTS = [DEPLOY / "smoke_install.sh", REPO / ".ci" / "system-deps.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_passes(script: Path) -> None:
    shellcheck = require_tool("shellcheck")
    result = run([shellcheck, str(script)])
    assert result.returncode == 0, result.stdout


def test_shellcheck_flags_an_unquoted_variable(tmp_path: Path) -> None:
    shellcheck = require_tool("shellcheck")
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $1/tmp\n")
    result = run([shellcheck, str(bad)])
    assert result.returncode != 0 and "SC2086" in result.stdout


def test_system_deps_does_not_reinstall_prometheus() -> None:
    for tool in ("prometheus", "promtool"):
        require_tool(tool)
    bash = shutil.which("bash")
    assert bash
    env = {**os.environ, "SYSTEM_DEPS_DRY_RUN": "1"}
    result = run([bash, str(REPO / ".ci" / "system-deps.sh")], env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    would_install = result.stdout.removeprefix("system-deps: would install").split()
    assert "prometheus" not in would_install


def test_a_missing_tool_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CELLSERVE_REQUIRE_TOOLS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no-such-tool"):
        require_tool("no-such-tool")
    monkeypatch.setenv("CELLSERVE_REQUIRE_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception, match="no-such-tool"):
        require_tool("no-such-tool")
