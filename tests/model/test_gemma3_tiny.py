"""A tiny random Gemma 3 (HF folder, window 8) against transformers: runs anywhere in seconds,
and pins the description (norm placement, (1 + w), q/k norms, scales, per-layer RoPE and window)
independently of the GGUF path that tests/model/test_gemma3.py covers."""

from __future__ import annotations

import pytest
import torch

import model.runner.worker
from model import load_model
from model.load.loader import LoadedModel
from model.runner.worker import make_worker
from tests.model.factories import Driver
from tests.tiny_models import write_tiny_gemma3


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    spread = float(ref.max() - ref.min())
    assert float((ours - ref).abs().max()) < 1e-4 * spread
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma") / "tiny")


@pytest.fixture(scope="module")
def tiny(folder) -> LoadedModel:
    return load_model(folder)


@pytest.fixture(scope="module")
def hf_tiny(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 13 * seed) % 300 + 5 for i in range(n)]


def test_description_read_from_the_config(tiny):
    args = tiny.config
    assert args.windows == (8, 8, 8, 0) and args.attn_scale == 24**-0.5
    assert args.rope.theta == 1e6 and args.rope_swa is not None and args.rope_swa.theta == 1e4
    assert [g.key for g in args.memory_spec.groups] == ["full", "swa8"]


def test_logits_match_transformers_over_chunks_past_the_window(tiny, hf_tiny):
    ids = prompt(40)
    with torch.inference_mode():
        ref = hf_tiny(torch.tensor([ids])).logits[0]
    driver = Driver(make_worker(tiny, n_cells=64), 64)
    ours = [
        driver.logits([driver.chunk(0, ids[a:b], all_rows=True)]) for a, b in [(0, 13), (13, 40)]
    ]
    assert_close(torch.cat(ours), ref)


def test_decode_past_the_window_matches_transformers_greedy(tiny, hf_tiny):
    ids = prompt(11, seed=1)
    with torch.inference_mode():
        out = hf_tiny.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    driver = Driver(make_worker(tiny, n_cells=64), 64, seed=1)
    tokens = driver.step([driver.chunk(0, ids)])
    while len(tokens) < 20:
        tokens += driver.step([driver.chunk(0, [tokens[-1]])])
    assert tokens == out[0, len(ids) :].tolist()


@pytest.mark.parametrize("kernels", [True, False])
def test_mixed_steps_equal_each_sequence_alone(tiny, kernels, monkeypatch):
    """Decode rows in and out of their window next to a prompt chunk, in one step; with the
    C++ decode kernel (windowed rows read their in-window cells) and with the torch path."""
    if not kernels:
        monkeypatch.setattr(model.runner.worker, "load_kernels", lambda: None)
    lengths = [3, 9, 30, 17]
    driver = Driver(make_worker(tiny, n_cells=256), 256, seed=2)
    driver.step([driver.chunk(s, prompt(n, s)) for s, n in enumerate(lengths[:3])])
    chunks = [driver.chunk(s, [17]) for s in range(3)] + [driver.chunk(3, prompt(17, 3))]
    together = driver.logits(chunks)
    for s, n in enumerate(lengths):
        alone = Driver(make_worker(tiny, n_cells=64), 64, seed=s)
        if s < 3:
            alone.step([alone.chunk(0, prompt(n, s))])
            ref = alone.logits([alone.chunk(0, [17])])
        else:
            ref = alone.logits([alone.chunk(0, prompt(n, s))])
        assert_close(together[s : s + 1], ref)


def test_batch_invariant_worker_pads_both_ropes_and_every_window(tiny):
    """--batch-invariant pads each step to MIN_ROWS rows: the sliding layers' RoPE tables and
    attention groups get the padding rows too; the logits stay those of the plain worker."""
    ids = prompt(12, seed=5)
    plain = Driver(make_worker(tiny, n_cells=64), 64, seed=5)
    padded = Driver(make_worker(tiny, n_cells=64, batch_invariant=True), 64, seed=5)
    for chunk in (ids, [17], [18]):
        assert_close(padded.logits([padded.chunk(0, chunk)]), plain.logits([plain.chunk(0, chunk)]))


def test_linear_rope_scaling_of_the_global_layers_matches_transformers(tmp_path):
    """Gemma 3 4B and larger: positions / factor on the global layers only."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_gemma3(tmp_path / "scaled", layer_types=("sliding", "full"), linear_rope=8)
    loaded = load_model(folder)
    assert loaded.config.rope.freq_factors == (8.0,) * 8
    assert loaded.config.rope_swa is not None and loaded.config.rope_swa.freq_factors is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt(30, seed=2)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    driver = Driver(make_worker(loaded, n_cells=64), 64)
    assert_close(driver.logits([driver.chunk(0, ids, all_rows=True)]), ref)
    unscaled = load_model(write_tiny_gemma3(tmp_path / "plain", layer_types=("sliding", "full")))
    plain = Driver(make_worker(unscaled, n_cells=64), 64)
    assert not torch.allclose(plain.logits([plain.chunk(0, ids, all_rows=True)]), ref, atol=1e-3)
