"""llama.cpp reads the tiny MoE GGUFs (tests/tiny_moe.py) as cellserve does: an independent
check of the layout (tensor names, the 3-D expert stacks, the metadata, GraniteMoE's permuted
Q/K and split gate|up) and of the routing. Needs the llama-server that bench/build_llamacpp.sh
builds; skips without it."""

from __future__ import annotations

import httpx
import pytest
import torch

from bench.server_proc import llama_server, llamacpp_default
from model import load_model
from model.kernels import load_kernels
from model.layers.ggml import has_block_kernels
from model.runner.worker import make_worker
from tests.model.factories import Driver
from tests.scheduler.fakes import make_prompt
from tests.tiny_moe import write_tiny_moe, write_tiny_moe_gguf

pytestmark = pytest.mark.model

# measured: F32 0.0023 (llama.cpp keeps K/V in float16), Q8_0 on the blocks 0.023 (olmoe)
TOLERANCE = {"F32": 0.01, "Q8_0": 0.05}


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe", "granitemoe"])
def test_llama_cpp_gives_the_same_next_token_logprobs(tmp_path, model_type, qtype):
    binary = llamacpp_default()
    if not binary.is_file():
        pytest.skip(f"no llama-server at {binary} (bench/build_llamacpp.sh builds it)")
    if qtype != "F32" and not has_block_kernels(load_kernels()):
        pytest.skip("the C++ block kernels are not built")
    folder = write_tiny_moe(tmp_path / model_type, model_type, seed=1)
    path = write_tiny_moe_gguf(tmp_path / f"{model_type}.gguf", folder, qtype=qtype)
    worker = make_worker(load_model(path, blocks=qtype != "F32"), n_cells=64)
    compared = 0
    with llama_server(binary, path, tmp_path / "llama.log", n_threads=1) as served:
        for seed in range(10):
            ids = make_prompt(5 + 4 * seed, seed=20 + seed)
            body = {"prompt": ids, "n_predict": 1, "n_probs": 5, "cache_prompt": False}
            body |= {"temperature": 0, "ignore_eos": True}
            out = httpx.post(f"{served.url}/completion", json=body, timeout=60).json()
            if "completion_probabilities" not in out:  # a partial UTF-8 token: held back
                continue
            top = out["completion_probabilities"][0]["top_logprobs"]
            driver = Driver(worker, 64, seed=seed)
            logits = driver.logits([driver.chunk(seed, ids)])[0]
            ours = torch.log_softmax(logits.double(), -1)
            assert top[0]["id"] == int(logits.argmax()), seed
            for t in top:
                assert abs(float(ours[t["id"]]) - t["logprob"]) < TOLERANCE[qtype], (seed, t)
            compared += 1
    assert compared >= 5
