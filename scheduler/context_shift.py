"""Context shift (llama.cpp server's `ctx_shift`): keep the first n_keep tokens, drop the next
n_discard, slide the tail down by n_discard positions. The K re-rotation is deferred to the
storage through the cells' pending ops."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcache.cells import SHARED, KVCells
from scheduler.sequence import Sequence


@dataclass(slots=True)
class ShiftPlan:
    n_keep: int
    n_discard: int
    num_copies: int  # shared cells of the tail: copy-on-write needs this many free cells


def clamp_n_keep(n_keep: int, num_prompt: int, n_ctx_seq: int) -> int:
    """n_keep < 0 keeps the whole prompt (llama.cpp); at least 4 positions stay shiftable."""
    if n_keep < 0:
        n_keep = num_prompt
    return max(0, min(n_keep, n_ctx_seq - 4))


def truncate_prompt(prompt: list[int], n_keep: int, n_ctx_seq: int) -> list[int]:
    """llama.cpp server's truncation of a prompt that does not fit: keep the first n_keep
    tokens, erase whole blocks of (n_ctx_seq - n_keep) // 2 tokens after them. The result is
    shorter than n_ctx_seq, so at least one token can be generated before the first shift."""
    if len(prompt) < n_ctx_seq:
        return prompt
    n_block = (n_ctx_seq - n_keep) // 2
    n_erased = (len(prompt) - n_keep - n_block) // n_block
    return prompt[:n_keep] + prompt[n_keep + n_erased * n_block :]


def plan_shift(cells: KVCells, seq: Sequence, n_ctx_seq: int) -> ShiftPlan:
    """What a shift of `seq` (all of whose tokens but the last are computed) would do."""
    req = seq.request
    n_past = seq.num_computed
    n_keep = clamp_n_keep(req.n_keep, seq.num_prompt, n_ctx_seq)
    n_left = n_past - n_keep
    n_discard = req.n_discard if req.n_discard is not None else n_left // 2
    n_discard = max(1, min(n_discard, n_left))
    kv_cells, kv_pos = cells.seq_cells(seq.seq_id)
    tail = kv_cells[kv_pos >= n_keep + n_discard]
    num_copies = int(np.count_nonzero(cells.owner_map()[tail] == SHARED)) if tail.size else 0
    return ShiftPlan(n_keep, n_discard, num_copies)


def apply_shift(cells: KVCells, seq: Sequence, plan: ShiftPlan) -> None:
    n0, n1 = plan.n_keep, plan.n_keep + plan.n_discard
    cells.seq_rm(seq.seq_id, n0, n1)
    cells.seq_add(seq.seq_id, n1, -1, -plan.n_discard)
    del seq.tokens[n0:n1]
    seq.num_computed -= plan.n_discard
    seq.num_shifts += 1
