"""Context shift (llama.cpp server's `ctx_shift`): keep the first n_keep tokens, drop the next
n_discard, slide the tail down by n_discard positions. The K re-rotation is deferred to the
storage through the memory's pending ops."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.memory import Memory
from scheduler.sequence import Sequence


@dataclass(slots=True)
class ShiftPlan:
    n_keep: int
    n_discard: int


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


def plan_shift(seq: Sequence, n_ctx_seq: int) -> ShiftPlan:
    """What a shift of `seq` (all of whose tokens but the last are computed) would drop."""
    req = seq.request
    n_keep = clamp_n_keep(req.n_keep, seq.num_prompt, n_ctx_seq)
    n_left = seq.num_computed - n_keep
    n_discard = req.n_discard if req.n_discard is not None else n_left // 2
    return ShiftPlan(n_keep, max(1, min(n_discard, n_left)))


def apply_shift(memory: Memory, seq: Sequence, plan: ShiftPlan) -> None:
    """Shift the cache and the sequence's tokens (memory.can_shift said yes and the
    copies-on-write have room)."""
    n0, n1 = plan.n_keep, plan.n_keep + plan.n_discard
    memory.seq_rm(seq.seq_id, n0, n1)
    memory.seq_add(seq.seq_id, n1, -1, -plan.n_discard)
    drop_tokens(seq, plan)


def drop_tokens(seq: Sequence, plan: ShiftPlan) -> None:
    """The token side of a shift (alone: the context is then recomputed from scratch)."""
    del seq.tokens[plan.n_keep : plan.n_keep + plan.n_discard]
    seq.num_computed -= plan.n_discard
    seq.num_shifts += 1
