"""llama.cpp reads the tiny dense GGUFs (tests/tiny_dense.py) as cellserve does: an independent
check of the layout and metadata (Gemma 2's stored 1 + w norms, caps and window; Phi-3's fused
attn_qkv / ffn_up, rope_factors_short / _long, attention factor and partial rotary; OLMo 2's
and EXAONE 4.0's post norms; GLM-4's four norms, biases and interleaved half-head RoPE;
Granite's scales and permuted Q/K). Needs the llama-server that
bench/build_llamacpp.sh builds; skips without it."""

from __future__ import annotations

import pytest

from bench.server_proc import llamacpp_command, llamacpp_default
from model import load_model
from model.kernels import load_kernels
from model.layers.ggml import has_block_kernels
from model.runner.worker import make_worker
from tests.llamacpp_server import assert_same_next_token_logprobs, llama_server_or_skip
from tests.model.factories import Driver
from tests.scheduler.fakes import make_prompt
from tests.tiny_dense import DENSE_TYPES, write_tiny_dense, write_tiny_dense_gguf

pytestmark = pytest.mark.model

# log-probabilities, measured 2026-12-02 (worst of the top 5 over 10 prompts): F32 5e-5 (gemma2),
# 0.0032 (phi3), 0.0023 (phi3-partial), 0.0052 (olmo2), 0.0026 (exaone4), 0.0025 (glm4), 0.0018
# (granite): the layout. Q8_0 on the blocks 0.0014 (gemma2, its logits capped to 3), 0.11 (phi3),
# 0.089 (phi3-partial), 0.087 (olmo2), 0.051 (exaone4), 0.087 (glm4), 0.12 (granite); the files'
# weights dequantized with float activations are 0.06-0.10 from llama.cpp too: its own rounding
# (int8 activations, float16 K/V) moves these small random 4-layer models that much, where a
# misread block would move them by whole units.
TOLERANCE = {"F32": 0.01, "Q8_0": 0.2}
# llama.cpp's context per sequence under bench.server_proc's command (-c over -np slots): Phi-3
# takes its long factors there, as cellserve's use_context picks for the same context
_CMD = llamacpp_command(llamacpp_default(), llamacpp_default(), 0, 1)
N_CTX_SEQ = int(_CMD[_CMD.index("-c") + 1]) // int(_CMD[_CMD.index("-np") + 1])


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("model_type", [*DENSE_TYPES, "phi3-partial"])
def test_llama_cpp_gives_the_same_next_token_logprobs(tmp_path, model_type, qtype):
    """ "phi3-partial": Phi-4-mini's shape, RoPE on half of each head."""
    binary = llama_server_or_skip()
    if qtype != "F32" and not has_block_kernels(load_kernels()):
        pytest.skip("the C++ block kernels are not built")
    kw = {"partial_rotary_factor": 0.5} if model_type == "phi3-partial" else {}
    folder = write_tiny_dense(tmp_path / model_type, model_type.split("-")[0], seed=1, **kw)
    path = write_tiny_dense_gguf(tmp_path / f"{model_type}.gguf", folder, qtype=qtype)
    loaded = load_model(path, blocks=qtype != "F32")
    loaded.config.use_context(N_CTX_SEQ)
    worker = make_worker(loaded, n_cells=64)
    prompts = [make_prompt(5 + 4 * seed, seed=20 + seed) for seed in range(10)]  # past windows
    # llama.cpp's top token is ours, or (rounded weights) within the tolerance of it
    assert_same_next_token_logprobs(
        binary, path, tmp_path / "llama.log", prompts,
        lambda seed, ids: (d := Driver(worker, 64, seed=seed)).logits([d.chunk(seed, ids)])[0],
        TOLERANCE[qtype], exact_argmax=False,
    )  # fmt: skip
