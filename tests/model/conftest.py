from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from model import LoadedModel, default_model_path, load_model
from tests.model.ssm_gguf import GRANITE_CASES, make_granite, make_mamba2

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """NOTE: CI shares 2 cores between test processes; an OpenMP team waiting on a descheduled
    thread at every op makes the model tests 5-10x slower than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm(smollm_path: Path) -> LoadedModel:
    return load_model(smollm_path, dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: Path):
    """transformers' own reading of the same GGUF: the independent reference."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name
    )


# the tiny Mamba2 and Granite 4.0-H folders of test_gguf_ssm.py and test_gguf_ssm_layout.py
@pytest.fixture(scope="module")
def mamba2_dir(tmp_path_factory) -> Path:
    return make_mamba2(tmp_path_factory.mktemp("mamba2") / "hf")


@pytest.fixture(scope="module", params=sorted(GRANITE_CASES))
def granite_case(request, tmp_path_factory) -> tuple[Path, list[str], bool]:
    layer_types, rope = GRANITE_CASES[request.param]
    folder = make_granite(tmp_path_factory.mktemp(request.param) / "hf", layer_types, rope)
    return folder, layer_types, rope
