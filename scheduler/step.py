"""The state of one scheduler step: what is planned so far, and what the last plan sampled."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import Sequence


@dataclass(slots=True)
class Step:
    budget: int  # tokens the step may still take (n_batch at the start)
    rows: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    num_scheduled: int = 0  # tokens in `rows`: the cells this step's apply will take
    num_decode: int = 0  # rows[:num_decode] are decode rows
    # after placement, for update(): the sequence of each SampleRow, and every seq in `rows`
    sampled: list[Sequence] = field(default_factory=list)
    in_plan: list[Sequence] = field(default_factory=list)
    _ids: set[int] = field(default_factory=set)  # id() of the sequences in `rows`
    # speculative decoding: id() of a decode row's sequence -> the tokens it drafted (its
    # row count in `rows` is 1 + len(drafts))
    drafts: dict[int, list[int]] = field(default_factory=dict)

    def add(self, seq: Sequence, n: int) -> None:
        self.rows.append((seq, n))
        self.num_scheduled += n
        self.budget -= n
        self._ids.add(id(seq))

    def extend(self, index: int, n: int) -> None:
        """n more rows for the sequence of rows[index]."""
        seq, m = self.rows[index]
        self.rows[index] = (seq, m + n)
        self.num_scheduled += n
        self.budget -= n

    def has(self, seq: Sequence) -> bool:
        """`seq` has rows this step (so it is never preempted in it)."""
        return id(seq) in self._ids

    @property
    def num_prompt_rows(self) -> int:
        """Tokens of rows that read prompts (not decode rows)."""
        return sum(n for _, n in self.rows[self.num_decode :])
