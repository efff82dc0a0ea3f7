"""Schemathesis against the server's own /openapi.json: for every operation, valid and invalid
inputs never get a 5xx, and every documented response matches its schema."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
)

from tests.reliability.harness import ServerProcess, record

MAX_EXAMPLES = 25
# Generations are capped at 4 tokens and 2 choices so that fuzzing stays fast on SmolLM2.
FUZZ_FLAGS = [
    "--n-cells", "512", "--n-seq-max", "8", "--ctx-per-seq", "256",
    "--max-tokens-limit", "4", "--max-n", "2", "--max-queue", "16",
]  # fmt: skip
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def fuzz_server():
    with ServerProcess(FUZZ_FLAGS) as srv:
        yield srv


def operations(url: str) -> list:
    """Every operation but the endless event streams (the cell map's), which a request-response
    fuzzer cannot read to the end; test_bad_input checks their parameters."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    return [op for op in ops if not op.path.endswith("/stream")]


def fuzzer(op, mode: GenerationMode, url: str, calls: dict[str, int]):
    """A hypothesis test over `op`'s generated cases (valid or invalid by `mode`)."""
    label = f"{op.label} {mode.value}"

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        if isinstance(case.body, dict):
            case.body.pop("stream", None)  # SSE answers are not in the JSON schema
        calls[label] = calls.get(label, 0) + 1
        case.call_and_validate(base_url=url, checks=CHECKS, timeout=60)

    return fuzz


@pytest.mark.slow
@pytest.mark.model
def test_every_operation_survives_schema_fuzzing(fuzz_server):
    url = fuzz_server.url
    ops = operations(url)
    labels = {op.label for op in ops}
    for expected in ("POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"):
        assert expected in labels, labels
    calls: dict[str, int] = {}
    failures: list[str] = []
    for op in ops:
        for mode in GenerationMode:
            try:
                fuzzer(op, mode, url, calls)()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing invalid to send (no inputs)
            except BaseException as exc:  # schemathesis raises an exception group
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                failures.append(f"{op.label} [{mode.value}]: {exc}"[:2000])
    assert not failures, "\n\n".join(failures)
    assert sum(calls.values()) >= len(ops) * 2, calls
    record("schema_fuzz", {"operations": len(ops), "calls": sum(calls.values())})
    assert httpx.get(f"{url}/health").status_code == 200
    assert fuzz_server.alive()
