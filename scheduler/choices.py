"""The n > 1 choices of a request: choice 0 reads the prompt while the others wait in its
`forks`; once the prompt is computed they become running sequences by a zero-copy seq_cp.

Everything the scheduler does differently because of n > 1 lives here: how many seq ids a
waiting choice needs, taking and releasing the forks' ids, the fork itself, and who takes
over the reading when choice 0 leaves early.
"""

from __future__ import annotations

from kvcache.memory import Memory
from scheduler.seq_ids import SeqIds
from scheduler.sequence import SeqState, Sequence


def take_seq_ids(seq: Sequence, seq_ids: SeqIds) -> None:
    """Seq ids for `seq` and its waiting forks (the caller checked num_seq_ids are free)."""
    seq.seq_id = seq_ids.take()
    for child in seq.forks:
        child.seq_id = seq_ids.take()


def release_fork_ids(seq: Sequence, seq_ids: SeqIds) -> None:
    """The waiting forks of a preempted `seq` give their (cell-less) seq ids back."""
    for child in seq.forks:
        seq_ids.release(child.seq_id)
        child.seq_id = -1


def fork(seq: Sequence, memory: Memory) -> list[Sequence]:
    """`seq` has just computed its prompt: its forks share every cell of it and run.
    Returns them (the caller gives them admission order and puts them in `running`)."""
    forks, seq.forks = seq.forks, []
    for child in forks:
        memory.seq_cp(seq.seq_id, child.seq_id, -1, -1)
        child.tokens = list(seq.tokens)
        child.num_computed = seq.num_computed
        child.num_cached = seq.num_cached
        child.queue_time = seq.queue_time
        child.parent = None
        if seq.constraint is not None:  # structured output: the grammar state forks too
            child.constraint = seq.constraint.fork()
        child.state = SeqState.RUNNING
    return forks


def leaving(seq: Sequence, reason: str) -> Sequence:
    """The sequence that actually leaves when `seq` finishes for `reason`.

    Choice 0 leaving while its prompt is shared (aborted alone, say): its first fork takes
    over the reading, so they swap identities (nothing was generated yet) and the fork
    leaves. An error takes the whole request down, so no swap."""
    if not seq.forks or reason == "error":
        return seq
    child = seq.forks[0]
    seq.index, child.index = child.index, seq.index
    seq.seed, child.seed = child.seed, seq.seed
    return child


def detach(seq: Sequence, seq_ids: SeqIds) -> None:
    """Take a fork still waiting in its parent out of it (its seq id owns no cells)."""
    assert seq.parent is not None
    seq.parent.forks.remove(seq)
    seq.parent = None
    if seq.seq_id >= 0:
        seq_ids.release(seq.seq_id)
