"""The integrity check of KVCells (tests call it after every operation): every cached quantity
recomputed from pos/owners, and the invariants in KVCells' NOTE asserted."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvcache.cells import KVCells


def check_cells(kv: KVCells) -> None:
    """Raises AssertionError naming the first cached quantity or invariant that is wrong."""
    empty = kv.pos == -1
    num_owners = kv.owners.sum(axis=0) + kv.held
    assert (num_owners == kv.num_owners).all(), "num_owners cache"
    assert ((num_owners == 0) == empty).all(), "pos == -1 <=> no owner"
    assert (kv.shift[empty] == 0).all(), "shift of an empty cell"
    assert (kv.pos >= -1).all(), "negative position"
    assert kv.used == int((~empty).sum()), "used"
    assert 0 <= kv.head < kv.n_cells, "head"
    assert (kv.seq_count == kv.owners.sum(axis=1)).all(), "seq_count"
    owner_xor = np.zeros(kv.n_cells, dtype=np.int32)
    for s in range(kv.n_seq_max):
        owner_xor[kv.owners[s]] ^= s
    assert (owner_xor == kv.owner_xor).all(), "owner_xor"
    assert kv.has_shift or not kv.shift.any(), "has_shift"
    for s in range(kv.n_seq_max):
        p = kv.pos[kv.owners[s]]
        want = (int(p.min()), int(p.max())) if p.size else (-1, -1)
        assert (kv.seq_pos_min(s), kv.seq_pos_max(s)) == want, f"seq {s} min/max"
