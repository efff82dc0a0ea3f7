"""Shared fixtures. `live_server`: the real model behind a real uvicorn, once per session."""

from __future__ import annotations

import pytest

from model.kernels import isa

isa.apply_forced_isa()  # before any torch op: the libraries read their caps once

from tests.live_server import LiveServer, start_server  # noqa: E402


def pytest_report_header(config: pytest.Config) -> str:
    """CELLSERVE_ISA=avx2 (or another level) runs the suite as a CPU of that level would: our
    kernels and torch's libraries capped there (model/kernels/isa.py)."""
    import torch

    d = isa.describe()
    forced = f", forced by CELLSERVE_ISA={d['forced']}" if d["forced"] else ""
    aten = torch.backends.cpu.get_cpu_capability()
    return f"cellserve ISA: {d['active']} (CPU: {d['cpu']}, {d['detected']}{forced}; ATen {aten})"


# small enough to start in seconds on 2 CPU cores, big enough for 16 concurrent streams
LIVE_SETTINGS = {
    "n_cells": 4096,
    "n_seq_max": 48,
    "n_batch": 256,
    "ctx_per_seq": 512,
    "drain_timeout": 5.0,
    "request_timeout": 120.0,
    # the reference mode: the API tests compare greedy texts across requests and batches, which
    # holds bit for bit only without quantized weights (the CPU default,
    # docs/configuration.md "Weights");
    # tests/deploy/test_serve_startup.py serves the default setup
    "quant": "none",
    "dtype": "float32",
}


@pytest.fixture(scope="session")
def live_server() -> LiveServer:
    server = start_server(**LIVE_SETTINGS)
    yield server
    server.stop()


@pytest.fixture
def server_factory():
    """start_server(backend_factory=None, **settings) -> LiveServer; all stopped at teardown."""
    started: list[LiveServer] = []

    def factory(backend_factory=None, **settings) -> LiveServer:
        server = start_server(backend_factory, **settings)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
