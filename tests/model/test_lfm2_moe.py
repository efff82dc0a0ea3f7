"""LFM2-MoE (Lfm2MoeForCausalLM, LFM2-8B-A1B's shape: LFM2's short convolutions and attention, a
dense first layer, then experts routed by sigmoid scores chosen with a selection bias, the top-k
renormalized and scaled) against transformers from the Hugging Face folder, from the GGUF that
llama.cpp's own converter writes and against llama-server on it; the one-call C++ step against
the Python layers; a random model with every weight redrawn (tests/tiny_ssm.py)."""

from __future__ import annotations

import pytest
import torch

from model import load_model
from model.arch.args import MoEArgs
from model.kernels import load_kernels
from model.layers.ggml import has_block_kernels
from model.layers.moe import MoEFeedForward
from model.layers.quant import quantize
from model.runner.native import NativeDecoder
from model.runner.worker import make_worker
from tests.llamacpp_convert import convert_with_llamacpp
from tests.llamacpp_server import assert_same_next_token_logprobs, llama_server_or_skip
from tests.model.state_driver import (
    Chunk,
    StateDriver,
    assert_close,
    greedy,
    hf_greedy,
    mixed_steps,
    prompt,
)
from tests.tiny_ssm import write_tiny_lfm2_moe

pytestmark = pytest.mark.model

# llama-server's next-token logprobs on the converter's F32 GGUF (top 5 of 6 prompts of 5-40
# tokens), measured 2026-12-06: 0.0012 (llama.cpp keeps K/V in float16)
LLAMA_CPP_F32 = 0.01


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """routed_scaling_factor 1.5: transformers applies it; llama.cpp's converter drops it."""
    return write_tiny_lfm2_moe(tmp_path_factory.mktemp("lfm2moe") / "hf", seed=1, scale=1.5)


@pytest.fixture(scope="module")
def hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def driver(tiny, n_cells: int = 512, n_slots: int = 8) -> StateDriver:
    worker = make_worker(tiny, n_cells=n_cells, group_cells=[n_cells, n_slots])
    return StateDriver(worker, n_cells, n_slots)


def test_description_read_from_the_config(folder):
    args = load_model(folder).config
    assert args.arch == "lfm2_moe" and args.hidden_dim == 96
    assert args.moe == MoEArgs(
        8,
        2,
        32,
        norm_topk_prob=True,
        gating="sigmoid",
        selection_bias=True,
        weights_scale=1.5,
    )
    assert args.moe_layers == (False, True, True, True, True)  # num_dense_layers 1
    assert "moe_sel_b" in args.layer_desc(1).weights
    assert "moe_sel_b" not in args.layer_desc(0).weights


@pytest.mark.parametrize("n", [4, 300])
def test_prompt_logits_match_transformers(folder, hf, n):
    ids = prompt(n, seed=n)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close(driver(load_model(folder)).logits([Chunk(0, ids, all_rows=True)]), ref)


def test_greedy_decode_and_chunks_match_transformers(folder, hf):
    tiny = load_model(folder)
    ids = prompt(40, seed=5)
    ref_tokens, ref = hf_greedy(hf, ids, 16)
    tokens, ours = greedy(driver(tiny), 0, ids, 16)
    assert_close(ours, ref)
    assert tokens == ref_tokens
    whole, parts = driver(tiny), driver(tiny)
    want = whole.logits([Chunk(0, ids)])
    for lo in range(0, len(ids), 7):
        got = parts.logits([Chunk(0, ids[lo : lo + 7])])
    assert_close(got, want, rel=1e-5)


def test_the_selection_bias_chooses_and_does_not_weigh(folder):
    """A bias that makes expert 5 win every row: every row routes to it, with its sigmoid
    score (renormalized, scaled) as its weight, not the biased one."""
    tiny = load_model(folder)
    moe = tiny.transformer.layers[1].feed_forward
    assert isinstance(moe, MoEFeedForward)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    assert moe.selection_bias is not None
    moe.selection_bias.data[5] = 100.0
    weights, experts = moe.route(x)
    assert (experts == 5).any(-1).all()
    scores = torch.sigmoid(x @ moe.router.T)
    chosen = scores.gather(1, experts)
    torch.testing.assert_close(weights, 1.5 * chosen / chosen.sum(-1, keepdim=True))


@pytest.mark.parametrize("kernels", [True, False])
def test_routing_keeps_the_bias_in_float32_and_never_divides_by_zero(folder, hf, kernels):
    """A bfloat16 model keeps the selection bias float32 (as transformers' buffer and llama.cpp's
    exp_probs_b): it picks among scores in [0, 1], where bfloat16 keeps 8 bits. k sigmoid
    scores that all underflow to 0 give zero weights, not NaN (llama.cpp's clamp of the sum),
    through the kernels' moe_route and through torch."""
    moe = load_model(folder, dtype="bfloat16").transformer.layers[1].feed_forward
    assert isinstance(moe, MoEFeedForward) and moe.selection_bias is not None
    assert moe.selection_bias.dtype == torch.float32
    assert torch.equal(moe.selection_bias, hf.model.layers[1].feed_forward.expert_bias)
    fused = load_kernels() if kernels else None
    if kernels and fused is None:
        pytest.skip("no C++ kernels built for this CPU")
    moe = load_model(folder).transformer.layers[1].feed_forward
    assert isinstance(moe, MoEFeedForward)
    moe.router.data.fill_(0.0)
    moe.router.data[:, 0] = 1.0
    x = torch.zeros(2, 64)
    x[:, 0] = -1000.0  # every logit -1000: every sigmoid score 0
    weights, experts = moe.route(x, fused)
    assert torch.equal(weights, torch.zeros(2, 2)) and experts.shape == (2, 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quant", ["int4", "int8", "gguf"])
def test_the_one_call_step_runs_lfm2_moe_as_the_python_layers(
    tmp_path_factory, dtype, quant, monkeypatch
):
    """moe_ffn's sigmoid routing with the selection bias and the scale in step.cpp: every step
    of sequences batched together (prompt chunks beside decode rows, a fork, a capture resumed
    by a new sequence) runs in one call and gives the Python layers' logits bit for bit."""
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("no C++ kernels built for this CPU")
    folder = write_tiny_lfm2_moe(tmp_path_factory.mktemp("lfm2moek") / "hf", dim=128, seed=5)
    if quant == "gguf":
        if not has_block_kernels(kernels):
            pytest.skip("a build without ggml_linear")
        path = convert_with_llamacpp(folder, folder.parent / "q8.gguf", pre="lfm2", outtype="q8_0")
        loaded = load_model(path, dtype=dtype, blocks=True)
    else:
        loaded = load_model(folder, dtype=dtype)
        quantize(loaded.transformer, quant)
    worker = make_worker(loaded, n_cells=512, group_cells=[512, 8])
    assert worker.paths.native is not None, worker.paths.describe()
    calls: list[int] = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = mixed_steps(worker, (3, 30, 9, 50, 20))
    assert len(calls) == 4 + 3 * (worker.paths.prompt_attention is not None)
    worker.paths.native = None
    assert torch.equal(native, mixed_steps(worker, (3, 30, 9, 50, 20)))


def test_llama_cpps_converter_and_server_agree(tmp_path, hf):
    """llama.cpp's convert_hf_to_gguf.py (LFM2MoeModel: experts stacked, expert_bias as
    exp_probs_b, leading_dense_block_count, expert_gating_func sigmoid) read back gives
    transformers' logits, and llama-server our next-token logprobs. Its converter writes no
    routed_scaling_factor, so the folder here has 1.0 (LFM2-8B-A1B's)."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_lfm2_moe(tmp_path / "hf", seed=2, scale=1.0)
    path = convert_with_llamacpp(folder, tmp_path / "lfm2moe.gguf", pre="lfm2")
    tiny = load_model(path)
    assert tiny.config.arch == "lfm2moe" and tiny.config.moe == load_model(folder).config.moe
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt(200, seed=3)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0]
    assert_close(driver(tiny).logits([Chunk(0, ids, all_rows=True)]), ref)
    binary = llama_server_or_skip()
    prompts = [prompt(5 + 7 * seed, seed=40 + seed) for seed in range(6)]
    assert_same_next_token_logprobs(
        binary, path, tmp_path / "llama.log", prompts,
        lambda _, ids: driver(tiny, n_cells=64).logits([Chunk(0, ids)])[0],
        LLAMA_CPP_F32, least=4,
    )  # fmt: skip
