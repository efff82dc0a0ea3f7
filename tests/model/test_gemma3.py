"""Gemma-3-270M (sliding window 512, every 6th layer global) against transformers on the same GGUF.

Float32 on both sides. The worker-level tests run on the unified cache (every layer keeps every
token's K/V, a sliding-window layer reads its window through its range); the scheduler-level
ones on the iSWA memory (the sliding-window layers on a pool of window x sequences + n_batch
cells), and on the unified cache where the two differ. Skips only where the
Gemma packages are not installed; fails there under CELLSERVE_REQUIRE_TOOLS=1 (CI).
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
import torch

from kvcache.cells import KVCells
from kvcache.make import make_memory
from kvcache.spec import Attention
from model import load_model
from model.load.loader import LoadedModel
from model.load.packaged import GEMMA3_INSTALL, gemma3_270m_path, gemma3_installed
from model.runner.worker import make_worker
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.model.factories import Driver, SeqChunk, make_plan, prefill_chunk
from tests.scheduler.fakes import Outcome, make_config, step

pytestmark = pytest.mark.model

WINDOW = 512
N_NEW = 12  # greedy tokens compared


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    spread = float(ref.max() - ref.min())
    diff = float((ours - ref).abs().max())
    assert diff < 1e-3 * spread, f"max abs diff {diff} vs logit range {spread}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def gemma_path():
    if not gemma3_installed():
        reason = f"the Gemma-3-270M packages are not installed: {GEMMA3_INSTALL}"
        if os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1":
            pytest.fail(reason + " (CELLSERVE_REQUIRE_TOOLS=1)")
        pytest.skip(reason)
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def gemma(gemma_path) -> LoadedModel:
    return load_model(gemma_path, dtype="float32")


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def text() -> str:
    """~1,600 tokens of varied English prose, code words and punctuation (stdlib docstrings)."""
    import argparse
    import difflib
    import heapq
    import json
    import subprocess

    docs = [inspect.getdoc(m) or "" for m in (argparse, json, heapq, difflib, subprocess)]
    return "\n\n".join(docs)


@pytest.fixture(scope="module")
def ids(gemma, text) -> list[int]:
    out = gemma.tokenizer.encode(text)
    assert out[0] == gemma.tokenizer.bos_id and len(out) >= 1500, len(out)
    return out[:1500]


@pytest.fixture(scope="module")
def reference(hf_gemma, ids):
    """transformers over the 1,500 tokens: final hidden states [1500, dim] and its cache, then
    N_NEW greedy tokens decoded from that cache (its own sliding-window cache layers)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_gemma.config)
    with torch.inference_mode():
        hidden = hf_gemma.model(torch.tensor([ids]), cache=cache, use_cache=True)
        hidden = hidden.last_hidden_state[0]
        greedy = [int(hf_gemma.lm_head(hidden[-1]).argmax())]
        for i in range(N_NEW - 1):
            pos = torch.tensor([[len(ids) + i]])
            out = hf_gemma(torch.tensor([[greedy[-1]]]), position_ids=pos, cache=cache)
            greedy.append(int(out.logits[0, -1].argmax()))
    return hidden, greedy


def test_memory_spec_is_five_sliding_layers_then_one_global(gemma):
    spec = gemma.config.memory_spec
    windows = [layer.window for layer in spec.layers if isinstance(layer, Attention)]
    assert windows == [0 if (i + 1) % 6 == 0 else WINDOW for i in range(18)]
    assert [g.key for g in spec.groups] == ["full", f"swa{WINDOW}"]
    assert gemma.config.rope.theta == 1e6 and gemma.config.rope_swa is not None
    assert gemma.config.rope_swa.theta == 1e4


def test_tokenizer_matches_transformers(gemma, gemma_path, text):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name)
    samples = [
        text[:3000],
        "two  spaces   three\ttab\n\n\nnewlines  ",
        "Ünïcödé ✓ 日本語のテキスト 🤖 Привет мир ¿Qué tal?",
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        "    def f(x):\n        return x ** 2  # [multimodal] <unused0>",
    ]
    for s in samples:
        ours = gemma.tokenizer.encode(s)
        assert ours == hf(s)["input_ids"], s[:40]
        assert gemma.tokenizer.decode(ours) == hf.decode(ours)
    assert gemma.tokenizer.bos_id == 2 and 1 in gemma.tokenizer.eos_ids


@pytest.mark.parametrize("n, chunks", [(100, [100]), (700, [512, 188]), (1500, [512, 512, 476])])
def test_logits_match_transformers_at_every_position(gemma, hf_gemma, reference, ids, n, chunks):
    """Prompts of 100, 700 and 1,500 tokens (the last two well past the 512 window), prefilled
    in the server's 512-token chunks; logits of every position against transformers'."""
    hidden, _ = reference
    driver = Driver(make_worker(gemma, n_cells=n + 8), n + 8, seed=n)
    start = 0
    for size in chunks:
        ours = driver.logits([driver.chunk(0, ids[start : start + size], all_rows=True)])
        with torch.inference_mode():
            ref = hf_gemma.lm_head(hidden[start : start + size]).float()
        assert_close(ours, ref)
        start += size
    assert start == n


def test_greedy_continuation_past_the_window_matches_transformers(gemma, reference, ids):
    _, hf_greedy = reference
    driver = Driver(make_worker(gemma, n_cells=1600), 1600, seed=3)
    tokens = driver.step([driver.chunk(0, ids[:512])])
    tokens = driver.step([driver.chunk(0, ids[512:1024])])
    tokens = driver.step([driver.chunk(0, ids[1024:])])
    ours = list(tokens)
    while len(ours) < N_NEW:
        ours += driver.step([driver.chunk(0, [ours[-1]])])
    assert ours == hf_greedy


def test_greedy_continuation_of_a_short_prompt_matches_transformers(gemma, hf_gemma, ids):
    prompt = ids[:60]
    with torch.inference_mode():
        out = hf_gemma.generate(
            torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW
        )
    driver = Driver(make_worker(gemma, n_cells=128), 128, seed=4)
    ours = driver.step([driver.chunk(0, prompt)])
    while len(ours) < N_NEW:
        ours += driver.step([driver.chunk(0, [ours[-1]])])
    assert ours == out[0, len(prompt) :].tolist()


def greedy(req_id: str, prompt: list[int], max_tokens: int, **kw: object) -> Request:
    kw.setdefault("sampling", SamplingParams(temperature=0.0))
    return Request(req_id, prompt, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def serve(
    model: LoadedModel, batches: list[list[Request]], memory: str = "iswa", **cfg: object
) -> tuple[Outcome, Scheduler]:
    """The real scheduler over the real worker, memory and storage built from the model's
    spec; each batch runs to completion in turn."""
    config = make_config(memory_spec=model.config.memory_spec, memory=memory, **cfg)
    mem = make_memory(
        config.memory_spec, config.n_cells, config.n_seq_max, config.n_batch, config.memory
    )
    sched = Scheduler(config, mem)
    group_cells = [mem.pools[i].cells.n_cells for i in mem.group_pools]
    worker = make_worker(model, config.n_cells, group_cells=group_cells)
    outcome = Outcome()
    for batch in batches:
        for r in batch:
            sched.add_request(r)
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
    return outcome, sched


def test_eight_concurrent_sequences_equal_each_alone(gemma, ids):
    """Different lengths, three past the window, prefilled and decoded in shared steps."""
    lengths = [20, 45, 90, 160, 260, 530, 580, 620]
    prompts = [ids[7 * i : 7 * i + n] for i, n in enumerate(lengths)]
    cfg: dict[str, object] = dict(n_cells=4096, n_seq_max=16, n_batch=512, n_ctx_seq=1024)
    together, sched = serve(gemma, [[greedy(f"r{i}", p, 6) for i, p in enumerate(prompts)]], **cfg)
    assert sched.counters.num_preemptions == 0
    for i, p in enumerate(prompts):
        alone, _ = serve(gemma, [[greedy(f"r{i}", p, 6)]], prefix_cache=False, **cfg)
        assert together.tokens[(f"r{i}", 0)] == alone.tokens[(f"r{i}", 0)], lengths[i]


@pytest.mark.parametrize("memory, num_cached", [("unified", 540), ("iswa", 0)])
def test_prefix_cache_hit_past_the_window_gives_the_cold_output(gemma, ids, memory, num_cached):
    """A 540-token cached prefix (longer than the window) reused by seq_cp: the sliding layers
    of the new tokens read cached cells inside their window, as a cold prefill does. Under
    iSWA the holder kept only its last 512 positions' window cells, so this prefix is not
    reusable there (kvcache/iswa.py) and is recomputed: the same output either way."""
    system = ids[:540]
    first = greedy("a", system + ids[600:610], 3)
    second = greedy("b", system + ids[700:716], 8)
    cfg: dict[str, object] = dict(n_cells=2048, n_ctx_seq=1024, n_batch=512)
    warm, _ = serve(gemma, [[first], [second]], memory, **cfg)
    assert warm.finish[("b", 0)].num_cached_tokens == num_cached
    cold, _ = serve(gemma, [[second]], memory, prefix_cache=False, **cfg)
    assert warm.tokens[("b", 0)] == cold.tokens[("b", 0)]


def place(cells: KVCells, seq_id: int, tokens: list[int], positions: list[int]) -> SeqChunk:
    slot = cells.find_slot(len(tokens))
    assert slot is not None
    cells.apply_ubatch(slot, np.array(positions), np.full(len(tokens), seq_id))
    kv_cells, kv_pos = cells.seq_cells(seq_id)
    return SeqChunk(seq_id, tokens, positions, slot.tolist(), kv_cells, kv_pos)


def test_shifted_sequence_equals_fresh_prefill_at_new_positions(gemma, ids):
    """560 tokens prefilled at 40.. then seq_add(-40): each layer's K is re-rotated with its own
    RoPE base (10k local, 1M global) and each window covers the same relative range, so the
    next token's logits equal a prefill at 0.. (also for an owner that keeps the old positions
    through copy-on-write)."""
    n, delta = 560, 40
    windows = gemma.config.memory_spec.windows
    worker = make_worker(gemma, n_cells=2 * n + 8)
    cells = KVCells(n_cells=2 * n + 8, n_seq_max=4)
    prompt, nxt = ids[:n], ids[n]
    worker.execute(
        make_plan([place(cells, 0, prompt, list(range(delta, delta + n)))], None, windows)
    )
    cells.seq_cp(0, 1, -1, -1)
    cells.seq_add(0, -1, -1, -delta)
    cells.check()
    pending = cells.take_pending()
    assert pending.shift_cells.size == n and pending.copy_src.size == n
    shifted = worker.forward(make_plan([place(cells, 0, [nxt], [n])], pending, windows))
    unshifted = worker.forward(make_plan([place(cells, 1, [nxt], [n + delta])], None, windows))
    fresh = make_worker(gemma, n_cells=n + 8)
    ref = fresh.forward(make_plan([prefill_chunk(0, prompt + [nxt], 0)], None, windows))
    assert_close(shifted, ref)
    assert_close(unshifted, ref)


def test_context_shift_over_shared_cells_equals_over_private_cells(gemma, ids):
    """The scheduler's context shift (seq_rm + seq_add + per-layer K re-rotation) three times,
    once over cells shared with a prefix holder (copy-on-write first): the same tokens.
    NOTE: a shift cannot equal a fresh prefill of the kept tokens on an 18-layer model: the
    kept K/V were computed while attending to the discarded ones (any model, window or not)."""
    system = ids[:20]
    warmup = greedy("w", system + [ids[30]], 2)
    probe = greedy("p", system + ids[40:42], 60, n_keep=4)
    cfg: dict[str, object] = dict(n_cells=128, n_ctx_seq=32, n_batch=32)
    shared, s_sched = serve(gemma, [[warmup], [probe]], **cfg)
    private, p_sched = serve(gemma, [[probe]], prefix_cache=False, **cfg)
    assert shared.finish[("p", 0)].num_cached_tokens == 20
    assert s_sched.counters.num_context_shifts == p_sched.counters.num_context_shifts >= 3
    assert shared.tokens[("p", 0)] == private.tokens[("p", 0)]
