"""The forward over cells against transformers, and the cache's invariants on SmolLM2."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvcache.cells import KVCells, PendingOps
from model import load_model
from model.kernels import load_decode_attention, load_kernels
from model.runner.worker import make_worker
from tests.model.factories import Driver, SeqChunk, make_plan, prefill_chunk
from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.model

TEXTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "Once upon a time, in a land far away, there lived a small dragon who loved to read. " * 6,
    "Les élèves ont étudié l'histoire de la Révolution française pendant trois semaines, "
    "puis ils ont écrit un essai sur les causes économiques et sociales. " * 3,
    "<|im_start|>user\nList ten prime numbers and explain why 1 is not prime.<|im_end|>\n"
    "<|im_start|>assistant\n" + "2, 3, 5, 7, 11, 13, 17, 19, 23, 29. " * 6,
]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    spread = float(ref.max() - ref.min())
    diff = float((ours - ref).abs().max())
    assert diff < 1e-3 * spread, f"max abs diff {diff} vs logit range {spread}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def worker(smollm):
    return make_worker(smollm, n_cells=1024)


@pytest.fixture(scope="module")
def text_ids(smollm) -> list[list[int]]:
    return [smollm.tokenizer.encode(t) for t in TEXTS]


def test_prompts_span_10_to_300_tokens(text_ids):
    lengths = sorted(len(ids) for ids in text_ids)
    assert lengths[0] >= 10 and 200 <= lengths[-1] <= 300, lengths


def test_logits_match_transformers(worker, hf_smollm, text_ids):
    for ids in text_ids:
        driver = Driver(worker, worker.storage.n_cells, seed=len(ids))
        ours = driver.logits([driver.chunk(0, ids, all_rows=True)])
        with torch.inference_mode():
            ref = hf_smollm(torch.tensor([ids])).logits[0].float()
        assert_close(ours, ref)


def test_decoding_through_cells_equals_recompute(worker, text_ids):
    ids = text_ids[2][:70]
    driver = Driver(worker, worker.storage.n_cells, seed=1)
    first = driver.logits([driver.chunk(0, ids[:20], all_rows=True)])
    steps = [driver.logits([driver.chunk(0, [t])])[0] for t in ids[20:]]
    assert len(steps) == 50
    recompute = Driver(worker, worker.storage.n_cells, seed=2)
    full = recompute.logits([recompute.chunk(0, ids, all_rows=True)])
    assert_close(torch.cat([first, torch.stack(steps)]), full)


def greedy_alone(worker, prompt: list[int], n_new: int) -> list[int]:
    driver = Driver(worker, worker.storage.n_cells, seed=3)
    out = driver.step([driver.chunk(0, prompt)])
    while len(out) < n_new:
        out += driver.step([driver.chunk(0, [out[-1]])])
    return out


def test_batched_sequences_never_see_each_other(worker, smollm):
    prompts = [
        smollm.tokenizer.encode(f"Question {i}: what is {i} times {i + 3}? " * (1 + i % 3))
        for i in range(8)
    ]
    n_new = 6
    alone = [greedy_alone(worker, p, n_new) for p in prompts]
    driver = Driver(worker, worker.storage.n_cells, seed=4)
    out: dict[int, list[int]] = {}
    # step 0: four prompts; step 1: their decodes mixed with the other four prompts
    for s, tok in enumerate(driver.step([driver.chunk(s, prompts[s]) for s in range(4)])):
        out[s] = [tok]
    chunks = [driver.chunk(s, [out[s][-1]]) for s in range(4)]
    chunks += [driver.chunk(s, prompts[s]) for s in range(4, 8)]
    for s, tok in enumerate(driver.step(chunks)):
        out.setdefault(s, []).append(tok)
    while any(len(out[s]) < n_new for s in range(8)):
        live = [s for s in range(8) if len(out[s]) < n_new]
        toks = driver.step([driver.chunk(s, [out[s][-1]]) for s in live])
        for s, tok in zip(live, toks, strict=True):
            out[s].append(tok)
    assert [out[s] for s in range(8)] == alone
    assert len({tuple(a) for a in alone}) > 1


def test_forked_sequence_continues_like_the_original(worker, text_ids):
    prompt = text_ids[1]
    expected = greedy_alone(worker, prompt, 8)
    driver = Driver(worker, worker.storage.n_cells, seed=5)
    first = driver.step([driver.chunk(0, prompt)])[0]
    driver.fork(0, 1)
    out = {0: [first], 1: [first]}
    while len(out[1]) < 8:
        toks = driver.step([driver.chunk(s, [out[s][-1]]) for s in (0, 1)])
        out[0].append(toks[0])
        out[1].append(toks[1])
    assert out[0] == expected and out[1] == expected


def place(cells: KVCells, seq_id: int, tokens: list[int], positions: list[int]) -> SeqChunk:
    slot = cells.find_slot(len(tokens))
    assert slot is not None
    cells.apply_ubatch(slot, np.array(positions), np.full(len(tokens), seq_id))
    kv_cells, kv_pos = cells.seq_cells(seq_id)
    return SeqChunk(seq_id, tokens, positions, slot.tolist(), kv_cells, kv_pos)


def test_shifted_sequence_equals_fresh_prefill_at_new_positions(smollm, text_ids):
    """Attention only sees relative positions, so a prompt prefilled at 100.. and shifted by
    -100 (K re-rotated in storage) must continue exactly like a prompt prefilled at 0.."""
    worker = make_worker(smollm, n_cells=256)
    cells = KVCells(n_cells=256, n_seq_max=4)
    ids = text_ids[2][:80]
    worker.execute(make_plan([place(cells, 0, ids, list(range(100, 180)))]))
    cells.seq_cp(0, 1, -1, -1)  # a second owner: the shift must copy-on-write
    cells.seq_add(0, -1, -1, -100)
    cells.check()
    pending = cells.take_pending()
    assert pending.shift_cells.size == 80 and pending.copy_src.size == 80
    nxt = 1234
    shifted = worker.forward(make_plan([place(cells, 0, [nxt], [80])], pending))
    unshifted = worker.forward(make_plan([place(cells, 1, [nxt], [180])], cells.take_pending()))

    fresh = make_worker(smollm, n_cells=256)
    ref = fresh.forward(make_plan([prefill_chunk(0, ids + [nxt], 0)]))
    assert_close(shifted, ref)
    assert_close(unshifted, ref)


def test_context_shift_discard_equals_fresh_prefill_of_kept_tokens(tmp_path):
    """seq_rm + seq_add + K-shift. With ONE layer the kept K/V do not depend on the discarded
    tokens, so the next logits must equal a fresh prefill of the kept tokens (with more layers
    the kept tokens' K/V still carry what they attended to before the shift)."""
    model = load_model(write_tiny_llama(tmp_path / "tiny", n_layers=1))
    ids = [(7 * i) % 300 + 5 for i in range(80)]
    n_keep, n_discard, nxt = 10, 30, 42

    def after_shift(apply_k_shift: bool) -> torch.Tensor:
        worker = make_worker(model, n_cells=128)
        cells = KVCells(n_cells=128, n_seq_max=2)
        worker.execute(make_plan([place(cells, 0, ids, list(range(80)))]))
        cells.seq_rm(0, n_keep, n_keep + n_discard)
        cells.seq_add(0, n_keep + n_discard, -1, -n_discard)
        cells.check()
        pending = cells.take_pending() if apply_k_shift else PendingOps.empty()
        return worker.forward(make_plan([place(cells, 0, [nxt], [80 - n_discard])], pending))

    kept = ids[:n_keep] + ids[n_keep + n_discard :] + [nxt]
    ref = make_worker(model, n_cells=128).forward(make_plan([prefill_chunk(0, kept, 0)]))
    assert_close(after_shift(apply_k_shift=True), ref)
    assert float((after_shift(apply_k_shift=False) - ref).abs().max()) > 1e-2


def test_decode_rows_of_very_different_context_lengths(tmp_path):
    """Short and long contexts decoded in one step (split into padded groups) give the logits
    each sequence gets alone."""
    model = load_model(write_tiny_llama(tmp_path / "tiny"))
    lengths = [3, 5, 300, 4, 40, 280]
    prompts = [[(11 * i + 3 * n) % 300 + 5 for i in range(n)] for n in lengths]
    driver = Driver(make_worker(model, n_cells=1024), 1024, seed=6)
    driver.step([driver.chunk(s, p) for s, p in enumerate(prompts)])
    together = driver.logits([driver.chunk(s, [17]) for s in range(len(prompts))])
    for s, p in enumerate(prompts):
        alone = Driver(make_worker(model, n_cells=1024), 1024, seed=s)
        alone.step([alone.chunk(0, p)])
        assert_close(together[s : s + 1], alone.logits([alone.chunk(0, [17])]))


def test_decode_attention_paths_agree(tmp_path, monkeypatch):
    """The bmm decode path (groups of SDPA_MAX_SEQS sequences and more), SDPA and the C++
    kernel (model/kernels) give the same logits on one batch of padded, masked contexts."""
    import model.layers.decoder

    loaded = load_model(write_tiny_llama(tmp_path / "tiny"))
    prompts = [[(7 * i + 5 * n) % 300 + 5 for i in range(n)] for n in (30, 24, 33, 27, 31)]
    kernel = load_decode_attention()
    if kernel is None and os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1":
        pytest.fail("the decode attention kernel did not build")
    paths = [(1, None), (100, None)] + ([(100, kernel)] if kernel is not None else [])
    results = []
    for limit, decode_kernel in paths:  # bmm for every group, SDPA, then the kernel
        monkeypatch.setattr(model.layers.decoder, "SDPA_MAX_SEQS", limit)
        worker = make_worker(loaded, n_cells=512)
        worker.paths.decode_attention = decode_kernel
        driver = Driver(worker, 512, seed=7)
        driver.step([driver.chunk(s, p) for s, p in enumerate(prompts)])
        results.append(driver.logits([driver.chunk(s, [17]) for s in range(len(prompts))]))
    for other in results[1:]:
        assert_close(other, results[0])


def test_prompt_attention_kernel_is_as_close_to_float32_as_sdpa(tmp_path):
    """bfloat16 prompt chunks (a first chunk, then a second one over the first's cells, cells in
    shuffled order) attend through the C++ prompt kernel where the CPU has AVX-512 BF16: its
    logits are as close to the float32 model's as SDPA's over the gathered cells are."""
    folder = write_tiny_llama(tmp_path / "tiny", dim=128, n_heads=4)  # head_dim 32
    runs = {}
    for name, dtype in (("kernel", "bfloat16"), ("sdpa", "bfloat16"), ("float32", "float32")):
        worker = make_worker(load_model(folder, dtype=dtype), n_cells=256)
        if name == "kernel" and worker.paths.prompt_attention is None:
            if os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1" and load_kernels() is None:
                pytest.fail("the C++ kernels did not build")
            pytest.skip("no prompt kernel here (AVX-512 BF16): SDPA only")
        if name == "sdpa":
            worker.paths.prompt_attention = None
        driver = Driver(worker, 256, seed=9)
        first = [(13 * i) % 300 + 5 for i in range(40)]
        second = [(7 * i) % 300 + 5 for i in range(23)]
        a = driver.logits([driver.chunk(0, first, all_rows=True), driver.chunk(1, second)])
        b = driver.logits([driver.chunk(0, second, all_rows=True)])  # reads the 40 cached cells
        runs[name] = torch.cat([a, b]).float()
    ref = runs["float32"]
    err = {name: float((runs[name] - ref).abs().mean()) for name in ("kernel", "sdpa")}
    assert err["kernel"] <= 1.25 * err["sdpa"], err
