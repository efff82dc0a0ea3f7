"""Finding the sequences that make the worker raise, so that only their requests fail.

When the worker raises on a batch, the engine re-runs the batch's sequences in halves until
each failing group is a single sequence (bisection: about 2 log2(n) extra calls for one
culprit). The other sequences keep the outputs of the re-runs, which equal those of the whole
batch: every row depends only on its own sequence's cells.

NOTE: a batch's pending cache work (copies, K-shifts) is applied by a call of its own before
the forward (`BatchPlan.pending_only`), and the forward and its re-runs carry none
(`BatchPlan.without_pending`): a K-shift applied twice would rotate K by twice the delta. A
recurrent group's state is read and written in place, so a worker whose forward raises must
leave every state slot as it was (write the new states only once the forward succeeded); a
re-run then reads the same states. A plan of ONE sequence is exempt: isolate fails a lone
sequence without re-running it, and its request's slot is released uncached.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvcache.cells import PendingOps
from scheduler.plan import BatchPlan, GroupBatch, SeqBatch, StepOutput, Worker


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def sub_plan(plan: BatchPlan, seq_indices: list[int]) -> tuple[BatchPlan, list[int]]:
    """The rows and samples of `plan.seqs[i]` for i in `seq_indices` (no pending work)
    -> (plan, index in `plan.samples` of each of its samples)."""
    rows: list[np.ndarray] = []
    seqs: list[SeqBatch] = []
    row_map: dict[int, int] = {}
    start = 0
    for i in seq_indices:
        s = plan.seqs[i]
        n = s.end - s.start
        rows.append(np.arange(s.start, s.end))
        row_map.update({s.start + k: start + k for k in range(n)})
        seqs.append(SeqBatch(s.seq_id, start, start + n, s.lora))
        start += n
    take = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    picked = [k for k, smp in enumerate(plan.samples) if smp.row in row_map]
    samples = [
        dataclasses.replace(plan.samples[k], row=row_map[plan.samples[k].row]) for k in picked
    ]
    new_index = {i: j for j, i in enumerate(seq_indices)}
    groups = [
        GroupBatch(
            g.key,
            g.window,
            g.cells[take],
            [g.seqs[i] for i in seq_indices] if g.seqs else [],  # recurrent groups have none
            PendingOps.empty(),
            [
                dataclasses.replace(c, seq=new_index[c.seq])
                for c in g.captures
                if c.seq in new_index
            ],
        )
        for g in plan.groups
    ]
    sub = BatchPlan(
        plan.token_ids[take],
        plan.positions[take],
        plan.seq_ids[take],
        seqs,
        groups,
        samples,
        plan.head_ids,
    )
    return sub, picked


def isolate(worker: Worker, plan: BatchPlan, error: str) -> tuple[StepOutput, dict[int, str]]:
    """`plan` (without pending work) made the worker raise `error`.

    -> (an output for every sample of `plan`, {seq_id: error} of the sequences that fail on
    their own). Samples of failed sequences get token 0: the caller fails their requests."""
    num = len(plan.samples)
    token_ids = [0] * num
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    embeddings: list[np.ndarray | None] | None = None
    failed: dict[int, str] = {}
    todo = [(list(range(len(plan.seqs))), error)]
    while todo:
        group, group_error = todo.pop()
        if len(group) == 1:
            failed[plan.seqs[group[0]].seq_id] = group_error
            continue
        mid = len(group) // 2
        for half in (group[:mid], group[mid:]):
            sub, picked = sub_plan(plan, half)
            try:
                out = worker.execute(sub)
            except Exception as exc:  # noqa: BLE001 - bisect further
                todo.append((half, describe(exc)))
                continue
            for j, k in enumerate(picked):
                token_ids[k] = out.token_ids[j]
            if out.logprobs is not None:
                logprobs = logprobs or [0.0] * num
                for j, k in enumerate(picked):
                    logprobs[k] = out.logprobs[j]
            if out.top_logprobs is not None:
                top = top or [[] for _ in range(num)]
                for j, k in enumerate(picked):
                    top[k] = out.top_logprobs[j]
            if out.embeddings is not None:
                embeddings = embeddings or [None] * num
                for j, k in enumerate(picked):
                    embeddings[k] = out.embeddings[j]
    return StepOutput(token_ids, logprobs, top, embeddings), failed
