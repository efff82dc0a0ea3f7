"""Linear RoPE scaling (positions / factor) on any family, from an HF folder and from the GGUF
llama.cpp's own converter writes (`rope.scaling.type linear`): it used to be read for Gemma 3
only; a Llama fine-tune stretched to a longer context ran with unscaled positions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvcache.rope import RopeConfig, linear_rope
from model import load_model
from model.runner.worker import make_worker
from tests.llamacpp_convert import convert_with_llamacpp
from tests.model.factories import Driver
from tests.model.test_gemma3_tiny import assert_close, prompt
from tests.tiny_models import write_tiny_llama

FACTOR = 4.0


def write_scaled_llama(folder: Path, factor: float) -> Path:
    folder = write_tiny_llama(folder, n_layers=2, seed=3)
    config = json.loads((folder / "config.json").read_text())
    theta = config.pop("rope_theta")
    config["rope_parameters"] = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def all_logits(path: Path, ids: list[int]) -> torch.Tensor:
    driver = Driver(make_worker(load_model(path), n_cells=64), 64)
    return driver.logits([driver.chunk(0, ids, all_rows=True)])


def test_linear_rope_divides_every_frequency_over_any_divisors():
    rope = RopeConfig(10000.0, 8)
    assert linear_rope(rope, 1.0) is rope
    assert linear_rope(rope, 4.0).freq_factors == (4.0,) * 4
    llama3 = RopeConfig(10000.0, 8, freq_factors=(1.0, 2.0, 3.0, 8.0))
    assert linear_rope(llama3, 2.0).freq_factors == (2.0, 4.0, 6.0, 16.0)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory) -> Path:
    return write_scaled_llama(tmp_path_factory.mktemp("linear") / "hf", FACTOR)


@pytest.fixture(scope="module")
def reference(scaled):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32).eval()
    ids = prompt(40, seed=4)
    with torch.inference_mode():
        return ids, hf(torch.tensor([ids])).logits[0]


def test_hf_folder_matches_transformers(scaled, reference):
    ids, ref = reference
    assert load_model(scaled).config.rope.freq_factors == (FACTOR,) * 8
    assert_close(all_logits(scaled, ids), ref)
    plain = write_tiny_llama(scaled.parent / "plain", n_layers=2, seed=3)
    assert not torch.allclose(all_logits(plain, ids), ref, atol=1e-3)  # the scaling shows


def test_llamacpp_gguf_matches_transformers(scaled, reference, tmp_path):
    ids, ref = reference
    path = convert_with_llamacpp(scaled, tmp_path / "scaled.gguf")
    assert load_model(path).config.rope.freq_factors == (FACTOR,) * 8
    assert_close(all_logits(path, ids), ref)
