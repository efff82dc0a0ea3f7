"""`python -m bench.memory_plan_bench`: what one decode step costs in the Memory's metadata
(plan + apply + take_pending) for the unified, recurrent and hybrid memories, side by side.

Each memory holds 32 sequences of 64 positions; a step feeds one token to each. No tensors:
this is the scheduler-side overhead a variant adds to every step.
"""

from __future__ import annotations

import time

import numpy as np

from kvcache.make import make_memory
from kvcache.spec import Attention, MemorySpec, Recurrent

N_SEQ = 32
PROMPT = 64
STEPS = 500
STATE = Recurrent(((3, 8), (2, 4, 4)))
SPECS = {
    "unified": MemorySpec.of([Attention(1, 4)] * 2),
    "recurrent": MemorySpec.of([STATE] * 2),
    "hybrid": MemorySpec.of([STATE, Attention(1, 4)]),
}


def step_us(spec: MemorySpec) -> float:
    mem = make_memory(spec, N_SEQ * (PROMPT + STEPS), N_SEQ + 8, 512)
    for s in range(N_SEQ):
        plan = mem.plan(np.arange(PROMPT), np.full(PROMPT, s))
        assert plan is not None
        mem.apply(plan)
        mem.take_pending()
    seq_ids = np.arange(N_SEQ)
    start = time.perf_counter()
    for i in range(STEPS):
        plan = mem.plan(np.full(N_SEQ, PROMPT + i), seq_ids)
        assert plan is not None
        mem.apply(plan)
        mem.take_pending()
    return (time.perf_counter() - start) / STEPS * 1e6


def main() -> None:
    base = step_us(SPECS["unified"])
    for name, spec in SPECS.items():
        us = base if name == "unified" else step_us(spec)
        print(f"{name:10s} {us:7.1f} us per decode step of {N_SEQ} sequences ({us / base:.1f}x)")


if __name__ == "__main__":
    main()
