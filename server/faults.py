"""Test-only fault injection around the worker. Inactive unless an env var below is set.

CELLSERVE_FAULT_TOKEN_ID=<id>       the worker raises on any batch that holds token <id>
                                    (after doing its work, as a forward pass failing late does)
CELLSERVE_FAULT_KILL_TOKEN_ID=<id>  same, but with an exception that ends the engine thread

The reliability tests (tests/reliability/test_faults.py) use these to check that the engine
isolates the request that breaks a batch and that a dead engine is noticed. Never set them in
production.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from scheduler.plan import BatchPlan, StepOutput

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
