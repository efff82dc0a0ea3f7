"""The attention groups of a ForwardBatch, built from a plan's per-group placement: decode
groups (one new token per sequence, padded kv), prompt groups (a chunk of one sequence), each
row seeing its window, and the batch-invariant padding."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from model.layers.batch import AttnGroups, DecodeGroup, ForwardBatch, PromptGroup
from scheduler.plan import BatchPlan, GroupBatch

ReadIndex = Callable[[np.ndarray], torch.Tensor | slice]  # KVStorage.read_index


class SeqRows(NamedTuple):
    """A sequence's rows [start, end) and, in one layer group's pool, the cells they can see:
    the memory's SeqCells from the first row's window on (sorted by position); the sequence's
    row r sees kv_cells[lo[r]:hi[r]]. The memory computed which (kvcache.memory.seq_cells_view);
    nothing here decides visibility again."""

    seq_id: int
    start: int
    end: int
    kv_cells: np.ndarray  # [n_kv] int64
    kv_pos: np.ndarray  # [n_kv] int64
    lo: np.ndarray  # [end - start] int64
    hi: np.ndarray  # [end - start] int64

    def visible(self) -> np.ndarray:
        """[end - start, n_kv] bool: row r sees kv[lo[r]:hi[r]]."""
        j = np.arange(len(self.kv_cells))
        return (j[None, :] >= self.lo[:, None]) & (j[None, :] < self.hi[:, None])


def group_seqs(plan: BatchPlan, group: GroupBatch) -> list[SeqRows]:
    out = []
    for s, view in zip(plan.seqs, group.seqs, strict=True):
        lo = int(view.lo[0])  # rows' windows only move forward
        cells, pos = view.kv_cells[lo:], view.kv_pos[lo:]
        out.append(SeqRows(s.seq_id, s.start, s.end, cells, pos, view.lo - lo, view.hi - lo))
    return out


# NOTE: CPU GEMM kernels (MKL, oneDNN) take shape-dependent paths for small row counts, so a
# row's result can depend on how many other rows share the matmul (~1e-5 apart). With
# batch_invariant, every forward has at least MIN_ROWS rows (padding rows read and write a
# scratch cell that no plan uses) and as many logit rows, and each sequence attends on its
# own: a sequence's logits are then bit-identical whatever else is in its batch
# (tests/reliability/test_worker_isolation.py). A decode step costs 2.2x alone, 1.1x at 16.
MIN_ROWS = 16


def pad_rows(batch: ForwardBatch, pads: dict[int, tuple[int, ReadIndex]]) -> ForwardBatch:
    """At least MIN_ROWS token rows and logit rows; padding rows are token 0 at position 0,
    attending only the scratch cell they write. pads: window -> (its pool's scratch cell, its
    storage's read_index)."""
    n = batch.tokens.shape[0]
    pad = MIN_ROWS - n
    if pad > 0:
        dev = batch.tokens.device
        zeros = torch.zeros(pad, dtype=torch.int64, device=dev)
        batch.tokens = torch.cat([batch.tokens, zeros])
        batch.rope_c, batch.rope_s = _pad_rope(batch.rope_c, batch.rope_s, pad)
        if batch.rope_swa is not None:
            batch.rope_swa = _pad_rope(*batch.rope_swa, pad)
        mask = torch.ones(pad, 1, dtype=torch.bool, device=dev)
        for window, (cell, read_index) in pads.items():
            g = batch.windowed.get(window) if window else None
            prompts = batch.prompts if g is None else g.prompts
            scratch = read_index(np.array([cell], dtype=np.int64))
            prompts.append(PromptGroup(n, n + pad, scratch, mask))
            if g is not None and g.cells is not None:
                g.cells = torch.cat([g.cells, zeros + cell])
            if window == 0:
                batch.cells = torch.cat([batch.cells, zeros + cell])
    n_out = batch.logit_rows.shape[0]
    if 0 < n_out < MIN_ROWS:
        extra = batch.logit_rows[-1:].expand(MIN_ROWS - n_out)
        batch.logit_rows = torch.cat([batch.logit_rows, extra])
    return batch


def _pad_rope(c: torch.Tensor, s: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding rows rotate by 0."""
    c = torch.cat([c, torch.ones_like(c[:1]).expand(pad, -1, -1)])
    return c, torch.cat([s, torch.zeros_like(s[:1]).expand(pad, -1, -1)])


def int64_tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def by_kv_length(seqs: list[SeqRows], max_waste: float = 0.5) -> list[list[SeqRows]]:
    """Split decode rows into groups whose padded kv wastes at most `max_waste` of the group
    (one sequence with a long context must not pad 31 short ones to its length)."""
    groups: list[list[SeqRows]] = []
    real = 0
    for s in sorted(seqs, key=lambda s: len(s.kv_cells)):
        n = len(s.kv_cells)
        padded = (len(groups[-1]) + 1) * n if groups else 0
        if groups and padded - (real + n) <= max_waste * padded:
            groups[-1].append(s)
            real += n
        else:
            groups.append([s])
            real = n
    return groups


def decode_group(
    seqs: list[SeqRows],
    n_rows: int,
    dtype: torch.dtype,
    read_index: ReadIndex,
    dev: torch.device,
) -> DecodeGroup:
    n_seq = len(seqs)
    max_kv = max(len(s.kv_cells) for s in seqs)
    kv_cells = np.zeros((n_seq, max_kv), dtype=np.int64)
    mask = np.zeros((n_seq, max_kv), dtype=bool)
    for i, s in enumerate(seqs):
        n = len(s.kv_cells)
        kv_cells[i, :n] = s.kv_cells
        mask[i, :n] = s.visible()[0]
    starts = [s.start for s in seqs]
    every_row = n_seq == n_rows and starts == list(range(n_rows))
    lens = np.array([len(s.kv_cells) for s in seqs], dtype=np.int64)
    prefix = bool(np.all(mask == (np.arange(max_kv)[None, :] < lens[:, None])))
    return DecodeGroup(
        rows=None if every_row else torch.tensor(starts, dtype=torch.int64, device=dev),
        kv_index=read_index(kv_cells.reshape(-1)),
        bias=None if mask.all() else _additive(torch.from_numpy(mask), dtype, dev)[:, None],
        max_kv=max_kv,
        cells=torch.from_numpy(kv_cells).to(dev) if prefix else None,
        lens=torch.from_numpy(lens).to(dev) if prefix else None,
    )


def _additive(mask: torch.Tensor, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """bool visible -> 0 / -inf in `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf")).to(dev)


def prompt_group(
    s: SeqRows, read_index: ReadIndex, dev: torch.device, order: bool = False
) -> PromptGroup:
    """`order`: also the cells (in position order) and each row's visible range, for the
    prompt kernel: row r sees cells[firsts[r]:lens[r]] (firsts only where a window cuts some of
    the chunk's cells: lo = 0 is full attention, or a window that cuts none yet)."""
    mask = s.visible()  # [L, n_kv]
    kv_index = read_index(np.asarray(s.kv_cells))
    group = PromptGroup(s.start, s.end, kv_index, torch.from_numpy(mask).to(dev))
    if order:
        group.cells = int64_tensor(s.kv_cells, dev)
        group.lens = int64_tensor(s.hi, dev)
        if s.lo.any():
            group.firsts = int64_tensor(s.lo, dev)
    return group


def plan_attn_groups(
    plan: BatchPlan,
    group: GroupBatch,
    read_index: ReadIndex,
    device: torch.device,
    dtype: torch.dtype,
    *,
    one_each: bool,
    ordered_prompts: bool,
    one_decode_group: bool,
) -> AttnGroups:
    """The attention groups of the layers of one plan group (0: full attention), over its
    pool's cells. `one_each` (batch-invariant): every sequence attends on its own, as a prompt
    group. `ordered_prompts` (the C++ prompt kernel): prompt chunks read their cells in
    position order, each row a range of them. `one_decode_group` (the C++ decode kernel): one
    group for every decode row when each attends a prefix of its cells (the kernel reads each
    one's own length), else groups that bound the padding.

    Windowed decode rows see exactly their in-window cells (group_seqs): a prefix of them,
    as full attention's rows.
    """
    seqs = group_seqs(plan, group)
    decode = [] if one_each else [s for s in seqs if s.end - s.start == 1]
    prompts = [
        prompt_group(s, read_index, device, ordered_prompts)
        for s in seqs
        if one_each or s.end - s.start != 1
    ]
    n_rows = len(plan.token_ids)

    def decode_rows(part: list[SeqRows]) -> DecodeGroup:
        return decode_group(part, n_rows, dtype, read_index, device)

    decodes: list[DecodeGroup] = []
    if decode:
        one = decode_rows(decode) if one_decode_group else None
        if one is not None and one.lens is not None:
            decodes = [one]
        else:
            decodes = [decode_rows(g) for g in by_kv_length(decode)]
    return AttnGroups(decodes, prompts, int64_tensor(group.cells, device))
