"""At the worker level, a sequence's logits do not depend on the other sequences of its batch:
B's logits are bit-identical whatever A's prompt holds, and (batch-invariant worker) whether
or not A is in the batch at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.cells import KVCells
from model import default_model_path, load_model
from model.load.loader import LoadedModel
from model.runner.worker import make_worker
from scheduler.plan import BatchPlan, SampleRow, SamplingParams, SeqBatch, full_group

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
    pos = np.array(positions, dtype=np.int64)
    for seq_id, start, end in placed:
        seqs.append(SeqBatch(seq_id, start, end))
        samples.append(SampleRow(end - 1, greedy, seed=0, output_index=0, num_prompt=end))
    kv = [cells.seq_cells(s.seq_id) for s in seqs]
    group = full_group(slot.astype(np.int64), kv, [pos[s.start : s.end] for s in seqs])
    return BatchPlan(
        token_ids=np.array(tokens, dtype=np.int64),
        positions=pos,
        seq_ids=np.array(seq_ids, dtype=np.int64),
        seqs=seqs,
        groups=[group],
        samples=samples,
    )


def run_b(
    smollm: LoadedModel, prompt_a: list[int] | None, a_first: bool, batch_invariant: bool
) -> list[torch.Tensor]:
    """B's logits over a prefill step and two decode steps, alone (prompt_a None) or in the
    same batches as A."""
    prompt_b = smollm.tokenizer.encode("Write a short poem about the sea and the wind:")
    worker = make_worker(smollm, N_CELLS, batch_invariant=batch_invariant)
    cells = KVCells(N_CELLS, 4)
    a = [] if prompt_a is None else [(0, prompt_a, 0)]
    b = [(1, prompt_b, 0)]
    plan = make_plan(cells, a + b if a_first else b + a)
    out = [worker.forward(plan)[-1 if a_first else 0].clone()]  # B's sampled row
    pos_a, pos_b = len(prompt_a or []), len(prompt_b)
    for token in (11, 22):
        a = [] if prompt_a is None else [(0, [token + 1], pos_a)]
        plan = make_plan(cells, a + [(1, [token], pos_b)])
        out.append(worker.forward(plan)[-1].clone())
        pos_a, pos_b = pos_a + 1, pos_b + 1
        cells.check()
    return out


def assert_same(xs: list[torch.Tensor], ys: list[torch.Tensor], what: str) -> None:
    for step, (x, y) in enumerate(zip(xs, ys, strict=True)):
        diff = (x - y).abs().max().item()
        assert torch.equal(x, y), f"{what}, step {step}: max |diff| {diff:g}"


def secret_prompt(smollm: LoadedModel, secret: str) -> list[int]:
    return smollm.tokenizer.encode(f"The password is {secret}. Repeat the password:")


@pytest.mark.model
def test_b_logits_do_not_depend_on_what_a_holds(smollm):
    """Default worker: A's content (its secret) cannot reach B's logits, bit for bit."""
    x, y = secret_prompt(smollm, "blue-zebra-4821"), secret_prompt(smollm, "red-otter-9305")
    assert len(x) == len(y) and x != y  # same shapes, different content
    for a_first in (True, False):
        with_x = run_b(smollm, x, a_first, batch_invariant=False)
        with_y = run_b(smollm, y, a_first, batch_invariant=False)
        assert_same(with_x, with_y, f"A holds X or Y, A first={a_first}")


@pytest.mark.model
def test_b_logits_are_bit_identical_with_or_without_a(smollm):
    """Batch-invariant worker: whether A shares B's batches at all does not change B's logits."""
    alone = run_b(smollm, None, a_first=True, batch_invariant=True)
    prompt_a = secret_prompt(smollm, "QX7-ZEBRA-4821")
    for a_first in (True, False):
        together = run_b(smollm, prompt_a, a_first, batch_invariant=True)
        assert_same(alone, together, f"with and without A, A first={a_first}")
