"""Small builders of BatchPlans for driving a worker without the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvcache.cells import PendingOps
from scheduler.plan import BatchPlan, SampleRow, SamplingParams, SeqBatch, full_group

GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence: token i sits at positions[i] in cells[i]; the sequence
    attends over kv_cells/kv_pos (which must include the new cells)."""

    seq_id: int
    tokens: list[int]
    positions: list[int]
    cells: list[int]
    kv_cells: list[int]
    kv_pos: list[int]
    sample_rows: list[int] = field(default_factory=lambda: [-1])  # relative to the chunk
    params: SamplingParams = field(default_factory=lambda: GREEDY)


def make_plan(
    chunks: list[SeqChunk], pending: PendingOps | None = None, windows: tuple[int, ...] = (0,)
) -> BatchPlan:
    """One group per layer group's window (the model's MemorySpec.groups), every group over
    the same cells: the unified cache."""
    token_ids: list[int] = []
    positions: list[int] = []
    seq_ids: list[int] = []
    cells: list[int] = []
    seqs: list[SeqBatch] = []
    kv: list[tuple[np.ndarray, np.ndarray]] = []
    samples: list[SampleRow] = []
    for c in chunks:
        start = len(token_ids)
        token_ids += c.tokens
        positions += c.positions
        seq_ids += [c.seq_id] * len(c.tokens)
        cells += c.cells
        end = len(token_ids)
        seqs.append(SeqBatch(c.seq_id, start, end))
        kv_pos = np.array(c.kv_pos, np.int64)
        order = np.argsort(kv_pos, kind="stable")
        kv.append((np.array(c.kv_cells, np.int64)[order], kv_pos[order]))
        for r in c.sample_rows:
            row = start + (r % len(c.tokens))
            samples.append(SampleRow(row, c.params, seed=0, output_index=0, num_prompt=0))
    pos = np.array(positions, np.int64)
    q_pos = [pos[s.start : s.end] for s in seqs]
    cell_arr = np.array(cells, np.int64)
    pending = PendingOps.empty() if pending is None else pending
    groups = [full_group(cell_arr, kv, q_pos, pending, window=w) for w in windows]
    return BatchPlan(
        token_ids=np.array(token_ids, np.int64),
        positions=pos,
        seq_ids=np.array(seq_ids, np.int64),
        seqs=seqs,
        groups=groups,
        samples=samples,
    )


def prefill_chunk(
    seq_id: int, tokens: list[int], first_cell: int, all_rows: bool = False
) -> SeqChunk:
    """A whole prompt at positions 0.. in contiguous cells from first_cell."""
    n = len(tokens)
    cells = list(range(first_cell, first_cell + n))
    rows = list(range(n)) if all_rows else [-1]
    return SeqChunk(seq_id, tokens, list(range(n)), cells, cells, list(range(n)), rows)


class Driver:
    """Runs sequences through a worker with a toy cell allocator (cells handed out in a
    shuffled order, so sequences interleave and cells are never in position order)."""

    def __init__(self, worker, n_cells: int, seed: int = 0) -> None:
        self.worker = worker
        self.windows = worker.model.args.memory_spec.windows
        self.free = list(np.random.default_rng(seed).permutation(n_cells).tolist())
        self.cells: dict[int, list[int]] = {}
        self.pos: dict[int, list[int]] = {}

    def chunk(self, seq_id: int, tokens: list[int], all_rows: bool = False) -> SeqChunk:
        cells = [self.free.pop() for _ in tokens]
        start = len(self.pos.setdefault(seq_id, []))
        positions = list(range(start, start + len(tokens)))
        self.cells.setdefault(seq_id, []).extend(cells)
        self.pos[seq_id].extend(positions)
        rows = list(range(len(tokens))) if all_rows else [-1]
        kv_cells, kv_pos = list(self.cells[seq_id]), list(self.pos[seq_id])
        return SeqChunk(seq_id, tokens, positions, cells, kv_cells, kv_pos, rows)

    def fork(self, src: int, dst: int) -> None:
        """seq_cp: dst shares src's cells (no data copied)."""
        self.cells[dst] = list(self.cells[src])
        self.pos[dst] = list(self.pos[src])

    def step(self, chunks: list[SeqChunk]) -> list[int]:
        return self.worker.execute(make_plan(chunks, windows=self.windows)).token_ids

    def logits(self, chunks: list[SeqChunk]):
        return self.worker.forward(make_plan(chunks, windows=self.windows))


def require_kernels(level: str | None = None):
    """The C++ kernels module (of `level`, default: the one the dispatcher picks). Not built:
    the test skips, or fails where CELLSERVE_REQUIRE_TOOLS=1 (CI: `make test` builds every level
    this CPU runs, so a missing one is a build failure, never an ISA it lacks)."""
    import os

    import pytest

    from model.kernels import kernel_dir, load_kernels

    module = load_kernels(level)
    if module is None:
        what = f"the {level} build of the C++ kernels" if level else "the C++ kernels"
        reason = f"{what} is not built in {kernel_dir()} (cellserve build-kernels)"
        if os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{reason} (CELLSERVE_REQUIRE_TOOLS=1)")
        pytest.skip(reason)
    return module
