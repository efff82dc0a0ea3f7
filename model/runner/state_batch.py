"""The recurrent layers' share of a BatchPlan: which rows decode one step over which state
slots, which chunks scan (and where they capture checkpoints)."""

from __future__ import annotations

import numpy as np
import torch

from model.layers.batch import StateBatch, StatePrompt
from model.runner.attn_groups import int64_tensor
from scheduler.plan import BatchPlan, GroupBatch


def state_batch(
    plan: BatchPlan, group: GroupBatch, batch_invariant: bool, device: torch.device
) -> StateBatch:
    """The recurrent layers' view of the plan (scheduler.plan.GroupBatch, recurrent): a
    lone row without captures is a one-step decode; any other chunk a scan. With
    batch_invariant every sequence scans on its own."""
    captures: dict[int, list[tuple[int, int]]] = {}
    for c in group.captures:
        first = int(plan.positions[plan.seqs[c.seq].start])
        captures.setdefault(c.seq, []).append((c.m - first, c.slot))
    rows: list[int] = []
    slots: list[int] = []
    prompts: list[StatePrompt] = []
    for i, s in enumerate(plan.seqs):
        slot = int(group.cells[s.start])
        assert bool(np.all(group.cells[s.start : s.end] == slot)), "one slot per sequence"
        caps = sorted(captures.get(i, []))
        assert all(0 < r <= s.end - s.start for r, _ in caps), "a capture inside the rows"
        if s.end - s.start == 1 and not caps and not batch_invariant:
            rows.append(s.start)
            slots.append(slot)
        else:
            prompts.append(StatePrompt(s.start, s.end, slot, caps))
    assert len(set(slots)) == len(slots), "decode rows of one step have distinct slots"
    if slots:  # in slot order: consecutive slots are then one range, updated in place
        slots, rows = map(list, zip(*sorted(zip(slots, rows, strict=True)), strict=True))
    n = plan.num_tokens
    every_row = rows == list(range(n))
    run = (slots[0], slots[0] + len(slots)) if slots else None
    return StateBatch(
        decode_rows=None if every_row else int64_tensor(np.array(rows), device),
        decode_slots=int64_tensor(np.array(slots), device),
        prompts=prompts,
        decode_run=run if run and slots == list(range(*run)) else None,
    )
