"""Place rows in a Memory and build their BatchPlan: the benches that drive a worker without
the scheduler (bench/gemma_bench.py, bench/recurrent_bench.py)."""

from __future__ import annotations

import numpy as np

from kvcache.memory import Memory
from scheduler.plan import BatchPlan, SampleRow, SamplingParams, SeqBatch, group_batches


def place_rows(
    memory: Memory, rows: list[tuple[int, list[int], int]], rollback: list[int] | None = None
) -> BatchPlan:
    """rows: (seq_id, tokens, first position); places them, samples each one's last row
    (greedy). `rollback`: Memory.plan's (sequences whose rows may be taken back)."""
    tokens: list[int] = []
    positions: list[int] = []
    seq_ids: list[int] = []
    seqs: list[SeqBatch] = []
    samples: list[SampleRow] = []
    greedy = SamplingParams(temperature=0.0)
    for seq, toks, p0 in rows:
        seqs.append(SeqBatch(seq, len(tokens), len(tokens) + len(toks)))
        tokens += toks
        positions += range(p0, p0 + len(toks))
        seq_ids += [seq] * len(toks)
        samples.append(SampleRow(len(tokens) - 1, greedy, seed=0, output_index=0, num_prompt=0))
    pos = np.array(positions, np.int64)
    mplan = memory.plan(pos, np.array(seq_ids, np.int64), rollback or ())
    assert mplan is not None, "the bench sizes its memory to fit"
    memory.apply(mplan)
    views = [memory.views(s.seq_id, pos[s.start : s.end]) for s in seqs]
    groups = group_batches(memory, mplan, views, memory.take_pending())
    return BatchPlan(np.array(tokens, np.int64), pos, mplan.seq_ids, seqs, groups, samples)
