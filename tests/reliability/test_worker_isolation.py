"""At the worker level, a sequence's logits do not depend on which other sequences share its
batch or the cache: B's logits are bit-identical with and without A (whose prompt holds a
secret) in the same batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.cells import KVCells, PendingOps
from model import default_model_path, load_model
from model.loader import LoadedModel
from model.worker import ModelWorker
from scheduler.plan import BatchPlan, SampleRow, SamplingParams, SeqBatch

N_CELLS = 256


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(default_model_path(), dtype="float32")
    torch.set_num_threads(before)


def make_plan(cells: KVCells, chunks: list[tuple[int, list[int], int]]) -> BatchPlan:
    """chunks: (seq_id, new token ids, position of the first one) -> a plan that places them
    in the cache and samples the last row of each chunk (greedy)."""
    tokens, positions, seq_ids, seqs, samples = [], [], [], [], []
    placed = []
    for seq_id, ids, p0 in chunks:
        start = len(tokens)
        tokens += ids
        positions += range(p0, p0 + len(ids))
        seq_ids += [seq_id] * len(ids)
        placed.append((seq_id, start, len(tokens)))
    slot = cells.find_slot(len(tokens))
    assert slot is not None
    cells.apply_ubatch(slot, np.array(positions), np.array(seq_ids))
    greedy = SamplingParams(temperature=0.0)
    for seq_id, start, end in placed:
        kv_cells, kv_pos = cells.seq_cells(seq_id)
        seqs.append(SeqBatch(seq_id, start, end, kv_cells, kv_pos))
        samples.append(SampleRow(end - 1, greedy, seed=0, output_index=0, num_prompt=end))
    return BatchPlan(
        token_ids=np.array(tokens, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        seq_ids=np.array(seq_ids, dtype=np.int64),
        cells=slot.astype(np.int64),
        seqs=seqs,
        samples=samples,
        pending=PendingOps.empty(),
    )


def logits(worker: ModelWorker, plan: BatchPlan) -> torch.Tensor:
    """[n_samples, vocab] raw logits of the plan's sampled rows."""
    with torch.inference_mode():
        return worker.model(worker.make_batch(plan), worker.storage).clone()


def run_b(smollm: LoadedModel, with_a: bool, a_first: bool) -> list[torch.Tensor]:
    """B's logits over a prefill step and two decode steps, alone or batched with A."""
    tok = smollm.tokenizer
    prompt_a = tok.encode("The password is QX7-ZEBRA-4821. Repeat the password:")
    prompt_b = tok.encode("Write a short poem about the sea and the wind:")
    worker = smollm.make_worker(N_CELLS)
    cells = KVCells(N_CELLS, 4)
    out = []
    a, b = (0, prompt_a, 0), (1, prompt_b, 0)
    step = [a, b] if a_first else [b, a]
    plan = make_plan(cells, step if with_a else [b])
    out.append(logits(worker, plan)[-1 if a_first else 0])  # B's sampled row
    next_b, pos_b = 11, len(prompt_b)
    next_a, pos_a = 22, len(prompt_a)
    for _ in range(2):
        chunks = [(0, [next_a], pos_a), (1, [next_b], pos_b)] if with_a else [(1, [next_b], pos_b)]
        plan = make_plan(cells, chunks)
        out.append(logits(worker, plan)[-1])
        pos_a, pos_b = pos_a + 1, pos_b + 1
        cells.check()
    return out


@pytest.mark.model
def test_b_logits_are_bit_identical_with_or_without_a(smollm):
    alone = run_b(smollm, with_a=False, a_first=True)
    for a_first in (True, False):
        together = run_b(smollm, with_a=True, a_first=a_first)
        for step, (x, y) in enumerate(zip(alone, together, strict=True)):
            diff = (x - y).abs().max().item()
            assert torch.equal(x, y), f"step {step}, A first={a_first}: max |diff| {diff:g}"
