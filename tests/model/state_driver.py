"""Drive a worker of a model with recurrent layers without the scheduler: a toy allocator of
attention cells and state slots that emits BatchPlans following scheduler.plan's contract
(slot per row in the recurrent group's cells, slot copies / zeroing in its pending, captures)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcache.cells import PendingOps
from scheduler.plan import BatchPlan, Capture, GroupBatch, SampleRow, SeqBatch, full_group
from tests.model.factories import GREEDY


@dataclass(slots=True)
class Chunk:
    seq_id: int
    tokens: list[int]
    all_rows: bool = False
    captures: list[tuple[int, int]] = field(default_factory=list)  # (m, slot)


class StateDriver:
    """Attention cells are handed out in a shuffled order; each sequence owns one state slot
    (the highest free one first, so slots are not in sequence order)."""

    def __init__(self, worker, n_cells: int = 512, n_slots: int = 8, seed: int = 0) -> None:
        self.worker = worker
        self.groups = worker.model.args.memory_spec.groups
        self.has_attn = any(g.key != "recurrent" for g in self.groups)
        self.free = list(np.random.default_rng(seed).permutation(n_cells).tolist())
        self.free_slots = list(range(n_slots))
        self.cells: dict[int, list[int]] = {}
        self.pos: dict[int, int] = {}
        self.slot: dict[int, int] = {}
        self.copies: list[tuple[int, int]] = []  # pending (src, dst), src -1: zero

    def new_slot(self) -> int:
        return self.free_slots.pop()

    def fork(self, src: int, dst: int) -> None:
        """seq_cp(src, dst): the cells are shared, the state is copied into a slot of dst's."""
        self.cells[dst] = list(self.cells[src])
        self.pos[dst] = self.pos[src]
        self.slot[dst] = self.new_slot()
        self.copies.append((self.slot[src], self.slot[dst]))

    def resume(self, seq: int, slot: int, n_past: int, cells: list[int]) -> None:
        """Start `seq` from a captured state in `slot` after n_past tokens (its cells)."""
        self.slot[seq], self.pos[seq], self.cells[seq] = slot, n_past, list(cells)

    def plan(self, chunks: list[Chunk]) -> BatchPlan:
        tokens: list[int] = []
        positions: list[int] = []
        seq_ids: list[int] = []
        cells: list[int] = []
        slots: list[int] = []
        seqs: list[SeqBatch] = []
        kv: list[tuple[np.ndarray, np.ndarray]] = []
        captures: list[Capture] = []
        samples: list[SampleRow] = []
        for i, c in enumerate(chunks):
            if c.seq_id not in self.slot:
                self.slot[c.seq_id] = self.new_slot()
                self.copies.append((-1, self.slot[c.seq_id]))
                self.pos[c.seq_id] = 0
            start, p0 = len(tokens), self.pos[c.seq_id]
            new_cells = [self.free.pop() if self.has_attn else -1 for _ in c.tokens]
            self.cells.setdefault(c.seq_id, []).extend(new_cells)
            self.pos[c.seq_id] = p0 + len(c.tokens)
            tokens += c.tokens
            positions += range(p0, p0 + len(c.tokens))
            seq_ids += [c.seq_id] * len(c.tokens)
            cells += new_cells
            slots += [self.slot[c.seq_id]] * len(c.tokens)
            seqs.append(SeqBatch(c.seq_id, start, len(tokens)))
            all_cells = self.cells[c.seq_id]
            kv.append((np.array(all_cells, np.int64), np.arange(len(all_cells), dtype=np.int64)))
            captures += [Capture(i, m, slot) for m, slot in c.captures]
            rows = range(start, len(tokens)) if c.all_rows else [len(tokens) - 1]
            samples += [SampleRow(r, GREEDY, 0, 0, 0) for r in rows]
        pos = np.array(positions, np.int64)
        q_pos = [pos[s.start : s.end] for s in seqs]
        groups = []
        for g in self.groups:
            if g.key == "recurrent":
                src, dst = zip(*self.copies, strict=True) if self.copies else ((), ())
                z = np.zeros(0, np.int64)
                pending = PendingOps(np.array(src, np.int64), np.array(dst, np.int64), z, z)
                slot_arr = np.array(slots, np.int64)
                groups.append(GroupBatch("recurrent", 0, slot_arr, [], pending, captures))
            else:
                groups.append(
                    full_group(np.array(cells, np.int64), kv, q_pos, window=g.spec.window)
                )
        self.copies = []
        return BatchPlan(
            np.array(tokens, np.int64), pos, np.array(seq_ids, np.int64), seqs, groups, samples
        )

    def logits(self, chunks: list[Chunk]):
        return self.worker.forward(self.plan(chunks))

    def step(self, chunks: list[Chunk]) -> list[int]:
        return self.worker.execute(self.plan(chunks)).token_ids


def prompt(n: int, seed: int = 0, vocab: int = 2048) -> list[int]:
    """Token ids spread over the whole vocabulary (the model's, not just the tokenizer's)."""
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def assert_close(ours, ref, rel: float = 1e-4) -> None:
    """Within rel of the logits' spread; equal argmax wherever the top-2 margin is larger
    than the tolerance."""
    import torch

    tol = rel * float(ref.max() - ref.min())
    assert float((ours - ref).abs().max()) < tol
    top2 = torch.topk(ref, 2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * tol
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


def hf_greedy(hf, ids: list[int], n_new: int):
    """transformers' reference: the prompt in one call, then one token per call through its
    cache -> (greedy tokens, logits of each step [n_new, vocab])."""
    import torch

    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True)
        steps = [out.logits[0, -1]]
        tokens = [int(steps[-1].argmax())]
        while len(tokens) < n_new:
            out = hf(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
            steps.append(out.logits[0, -1])
            tokens.append(int(steps[-1].argmax()))
    return tokens, torch.stack(steps)


def greedy(driver: StateDriver, seq: int, ids: list[int], n_new: int):
    """Ours, the same way: -> (tokens, logits [n_new, vocab])."""
    import torch

    steps = [driver.logits([Chunk(seq, ids)])[0]]
    tokens = [int(steps[-1].argmax())]
    while len(tokens) < n_new:
        steps.append(driver.logits([Chunk(seq, [tokens[-1]])])[0])
        tokens.append(int(steps[-1].argmax()))
    return tokens, torch.stack(steps)


def mixed_steps(worker, lengths: tuple[int, ...] = (3, 30, 9, 50, 20)) -> torch.Tensor:
    """Seven steps of sequences batched together over a worker with 8 state slots and 512
    cells: three with prompt chunks beside decode rows (a capture mid-chunk into slot 0, a fork,
    a new sequence resumed from the capture), then four decode steps of five sequences; prompts
    of `lengths`. The logits of every step, concatenated (the one-call step against the Python
    layers: tests/model/test_lfm2.py, test_mamba2.py)."""
    p = {s: prompt(n, seed=s) for s, n in enumerate(lengths)}
    d = StateDriver(worker, 512, 8)
    d.free_slots = [0, 2, 3, 4, 5, 6, 7, 1]  # seq 0 takes slot 1; its capture goes to 0
    out = [d.logits([Chunk(0, p[3], captures=[(21, 0)]), Chunk(1, p[1]), Chunk(2, p[2])])]
    d.fork(1, 4)
    out.append(d.logits([Chunk(0, [40]), Chunk(1, [41]), Chunk(2, p[4]), Chunk(4, [99])]))
    d.resume(5, 0, 21, d.cells[0][:21])
    out.append(d.logits([Chunk(5, p[0]), Chunk(1, [51]), Chunk(4, [54]), Chunk(0, [7])]))
    for t in range(4):
        out.append(d.logits([Chunk(s, [60 + t]) for s in (0, 1, 2, 4, 5)]))
    return torch.cat(out)


def check_chunks_mixed_steps_and_captures(new: Callable[[], StateDriver]) -> None:
    """Over fresh drivers from `new`: a prompt in chunks equals one prefill; decode rows beside
    a prompt chunk equal each sequence alone; a captured state resumes like a prefill of its
    prefix (its cells too). For hybrids (attention cells + state slots)."""
    ids = prompt(300, seed=2)
    ref = new().logits([Chunk(0, ids)])
    parts = new()
    for lo in range(0, 300, 70):
        ours = parts.logits([Chunk(0, ids[lo : lo + 70])])
    assert_close(ours, ref)
    d = new()
    d.logits([Chunk(s, prompt(9 + s, s)) for s in range(3)])
    together = d.logits([Chunk(s, [40 + s]) for s in range(3)] + [Chunk(3, prompt(50, 3))])
    for s in range(4):
        alone = new()
        if s < 3:
            alone.logits([Chunk(0, prompt(9 + s, s))])
        want = alone.logits([Chunk(0, [40 + s] if s < 3 else prompt(50, 3))])
        assert_close(together[s : s + 1], want)
    d = new()
    d.free_slots = [0, 1]  # the sequence takes slot 1; the capture goes to slot 0
    d.logits([Chunk(0, ids[:100], captures=[(37, 0)])])
    ref = new()
    ref.logits([Chunk(0, ids[:37])])
    d.resume(5, 0, 37, d.cells[0][:37])  # over the first 37 cells of sequence 0
    nxt = ids[37:45]
    assert_close(d.logits([Chunk(5, nxt, all_rows=True)]), ref.logits([Chunk(0, nxt, True)]))
