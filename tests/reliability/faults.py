"""Test-only fault injection around the worker, and a `cellserve` entry point that injects it.

    python -c "from tests.reliability.faults import main; main()" serve ...

serves like `cellserve serve`, with the worker wrapped when an env var below is set:

CELLSERVE_FAULT_TOKEN_ID=<id>       the worker raises on any batch that holds token <id>
                                    (after doing its work, as a forward pass failing late does)
CELLSERVE_FAULT_KILL_TOKEN_ID=<id>  same, but with an exception that ends the engine thread

The production app never imports this module: the hook is injected through create_app's backend
factory (server.model_backend.load_backend's `wrap_worker`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from scheduler.plan import BatchPlan, StepOutput
from scheduler.stats import StepStats
from server.backend import Backend
from server.settings import Settings

log = logging.getLogger("cellserve.server")

FAULT_ENV = "CELLSERVE_FAULT_TOKEN_ID"
KILL_ENV = "CELLSERVE_FAULT_KILL_TOKEN_ID"


class InjectedFault(RuntimeError):
    pass


class InjectedEngineDeath(BaseException):
    """Not an Exception: the engine's per-batch handler does not catch it, so its loop ends."""


class FaultyWorker:
    def __init__(self, worker: Any, fault_token_id: int | None, kill_token_id: int | None) -> None:
        self.worker = worker
        self.fault_token_id = fault_token_id
        self.kill_token_id = kill_token_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)

    def execute(self, plan: BatchPlan) -> StepOutput:
        out = self.worker.execute(plan)
        if self.kill_token_id is not None and (plan.token_ids == self.kill_token_id).any():
            raise InjectedEngineDeath(f"injected engine death ({KILL_ENV}={self.kill_token_id})")
        if self.fault_token_id is not None and (plan.token_ids == self.fault_token_id).any():
            raise InjectedFault(f"injected fault ({FAULT_ENV}={self.fault_token_id})")
        return out


def wrap_worker(worker: Any, environ: Mapping[str, str] = os.environ) -> Any:
    """The worker itself, or a FaultyWorker when a fault env var is set."""
    fault, kill = environ.get(FAULT_ENV), environ.get(KILL_ENV)
    if fault is None and kill is None:
        return worker
    log.warning("TEST-ONLY fault injection is on (%s=%s, %s=%s)", FAULT_ENV, fault, KILL_ENV, kill)
    return FaultyWorker(
        worker,
        None if fault is None else int(fault),
        None if kill is None else int(kill),
    )


def faulty_backend(settings: Settings, on_step: Callable[[StepStats], None]) -> Backend:
    from server.model_backend import load_backend

    return load_backend(settings, on_step, wrap_worker=wrap_worker)


def main() -> None:
    from cli.main import main as cli_main

    sys.exit(cli_main(sys.argv[1:], backend_factory=faulty_backend))
