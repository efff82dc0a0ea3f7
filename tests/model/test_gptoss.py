"""gpt-oss: a tiny random GptOssForCausalLM built by transformers (tests/tiny_gptoss.py) against
transformers in float32 (logits, greedy decoding, prompts past the window of 8), from its HF
folder and from the GGUF llama.cpp's own converter writes; the pieces apart (attention sinks,
the clamped SwiGLU, YaRN, MXFP4 blocks); the paths it takes; the real scheduler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcache.rope import RopeConfig, yarn
from model import load_model
from model.errors import ModelLoadError
from model.kernels import load_kernels
from model.layers.blocks import swiglu_oai
from model.layers.ggml import has_block_kernels
from model.layers.quant import quantize
from model.load.gguf import dequantize
from model.load.gguf_file import GGUFTensor
from model.runner.native import NativeDecoder
from model.runner.worker import make_worker
from tests.llamacpp_convert import convert_with_llamacpp
from tests.model.factories import Driver, require_kernels
from tests.model.test_dense_families import (
    check_together_equals_alone,
    greedy,
    logits,
    prompt,
    reference,
)
from tests.model.test_native import decode
from tests.tiny_gptoss import WINDOW, YARN, write_tiny_gptoss, write_tiny_gptoss_mxfp4

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_gptoss(tmp_path_factory.mktemp("gptoss") / "hf", seed=1)


@pytest.fixture(scope="module")
def truncated(tmp_path_factory):
    """The same model with YaRN's ramp ends rounded (transformers' default truncate): as
    llama.cpp's rope_yarn_corr_dims rounds them, and its converter does not write truncate."""
    folder = tmp_path_factory.mktemp("gptoss-truncated") / "hf"
    return write_tiny_gptoss(folder, seed=1, rope_parameters=YARN | {"truncate": True})


@pytest.fixture(scope="module")
def gguf_path(truncated):
    return convert_with_llamacpp(truncated, truncated.parent / "gptoss.gguf")


def hf_reference(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_model(folder):
    return hf_reference(folder)


@pytest.fixture(scope="module")
def hf_truncated(truncated):
    return hf_reference(truncated)


def source(fmt: str, request) -> tuple[object, object]:
    """(what cellserve loads, the transformers model it must equal)."""
    if fmt == "hf":
        return request.getfixturevalue("folder"), request.getfixturevalue("hf_model")
    return request.getfixturevalue("gguf_path"), request.getfixturevalue("hf_truncated")


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_description_read_from_the_config_and_the_file(request, fmt):
    args = load_model(source(fmt, request)[0]).config
    assert args.windows == (WINDOW, 0, WINDOW, 0)  # layer_types; llama.cpp's pattern of 2
    assert args.attn_sinks and args.qkv_bias and args.out_bias
    assert args.head_dim * args.n_heads != args.dim
    moe = args.moe
    assert moe is not None and (moe.n_experts, moe.n_used, moe.expert_dim) == (4, 2, 32)
    assert moe.bias and moe.norm_topk_prob and moe.swiglu_limit == 7.0
    assert args.rope.attn_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert args.rope.freq_factors == yarn(10000.0, 32, 4.0, 64, truncate=fmt == "gguf").freq_factors
    assert "sinks" in args.layer_desc(1).weights and "b2_exps" in args.layer_desc(1).weights


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("n", [9, 40])  # within the window of 8 and five times past it
def test_logits_match_transformers(request, fmt, n):
    path, hf_model = source(fmt, request)
    ids = prompt(n, seed=2)
    want = reference(hf_model, ids)
    got = logits(load_model(path), ids)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("n", [5, 40])
def test_greedy_decoding_matches_transformers_generate(request, fmt, n):
    path, hf_model = source(fmt, request)
    ids = prompt(n, seed=4)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert greedy(load_model(path), ids, 16) == out[0, n:].tolist()


def test_concurrent_requests_through_the_scheduler_each_equal_alone(folder):
    """The real scheduler over the iSWA memory's two pools, prompt chunks and decodes mixed:
    each request's greedy tokens are the ones it gets alone."""
    check_together_equals_alone(load_model(folder))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quant, n_seq", [("int4", 1), ("int4", 10), ("int8", 3)])
def test_the_one_call_step_runs_gptoss_as_the_python_layers(
    folder, dtype, quant, n_seq, monkeypatch
):
    """step.cpp with the sinks, the wo / router / expert biases and the clamped SwiGLU: bit for
    bit the Python layers' logits over prompts longer than the window (the prompt kernel
    reading each row's window) and decode steps past it."""
    require_kernels()
    loaded = load_model(folder, dtype=dtype)
    quantize(loaded.transformer, quant)
    worker = make_worker(loaded, n_cells=512)
    assert worker.paths.native is not None, worker.paths.describe()
    assert worker.paths.decode_attention is not None
    prompts = [prompt(9 + 5 * s, seed=s) for s in range(n_seq)]
    calls = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = decode(worker, prompts, steps=6)
    assert len(calls) == 6 + (worker.paths.prompt_attention is not None)
    worker.paths.native = None
    assert torch.equal(native, decode(worker, prompts, steps=6))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_attention_kernels_take_the_sinks(folder, dtype):
    """decode_attention and prompt_attention with sinks (attention.cpp, the AVX2 float32 and
    AVX-512 BF16 kernels, the scalar loop) against the torch attention of the same model:
    a 40-token prompt chunk and decode steps past the window."""
    kernels = require_kernels()
    ids, then = prompt(40, seed=6), prompt(8, seed=7)
    worker = make_worker(load_model(folder, dtype=dtype), n_cells=128)
    assert worker.paths.decode_attention is not None
    if kernels.has_f32_kernels() if dtype == "float32" else kernels.has_bf16_kernels():
        assert worker.paths.prompt_attention is not None, worker.paths.describe()
    got = decode_steps(worker, ids, then)
    worker = make_worker(load_model(folder, dtype=dtype), n_cells=128)
    worker.paths.decode_attention = worker.paths.prompt_attention = None
    want = decode_steps(worker, ids, then)
    # bfloat16: both round (p to bfloat16 before V, the scores' sums), not in the same order
    # (measured up to 4.5% of the largest logit; the kernels without the sinks: 52%)
    tol = 1e-5 if dtype == "float32" else 0.1
    assert float((got - want).abs().max()) < tol * float(want.abs().max())


def decode_steps(worker, ids: list[int], then: list[int]) -> torch.Tensor:
    """The prompt's last logits, then those of one decode step per token of `then` (the same
    tokens whatever either path would pick): [1 + len(then), vocab]."""
    driver = Driver(worker, 128, seed=3)
    out = [driver.logits([driver.chunk(0, ids)])[0]]
    out += [driver.logits([driver.chunk(0, [t])])[0] for t in then]
    return torch.stack(out).float()


def test_bfloat16_is_close_to_float32(folder):
    """Top-1 agrees wherever float32's is clear (its top two at least 5% of the row's largest
    logit apart), and on most rows: this random model's near-ties flip with any change of
    rounding: with the prompt kernel over the window (more exact than torch's bfloat16 matmuls
    at the op) 5 of these 40 rows disagree, all within 4.2%; with the torch path, 2)."""
    ids = prompt(40, seed=3)
    full = logits(load_model(folder), ids)
    half = logits(load_model(folder, dtype="bfloat16"), ids).float()
    agree = half.argmax(-1) == full.argmax(-1)
    top2 = full.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) >= 0.05 * full.abs().amax(-1)
    assert bool(agree[clear].all()) and int(clear.sum()) >= 20
    assert float(agree.float().mean()) >= 0.8


def test_a_sink_takes_its_share_of_the_softmax():
    """One query, two keys: the weights are exp(s_j) / (exp(sink) + sum exp(s)); a sink of
    -inf is plain attention."""
    from model.layers.decoder import Attention

    attn = Attention.__new__(Attention)
    torch.nn.Module.__init__(attn)
    attn.scale, attn.softcap = 1.0, 0.0
    q = torch.tensor([[[1.0, 0.0]]])  # [1, g = 1, hd = 2]
    k = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # scores 1, 0
    v = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    sink = torch.tensor([[[0.5]]])
    denom = math.exp(0.5) + math.e + 1.0
    out = attn._attend(q, k, v, None, sink)
    torch.testing.assert_close(out, torch.tensor([[[math.e / denom, 1.0 / denom]]]))
    plain = attn._attend(q, k, v, None, torch.tensor([[[-math.inf]]]))
    torch.testing.assert_close(plain, torch.softmax(torch.tensor([[1.0, 0.0]]), -1)[None])


def test_the_clamped_swiglu_as_transformers_computes_it():
    """(min(up, 7) clamped below at -7, + 1) * g * sigmoid(1.702 g), g = min(gate, 7)."""
    gate = torch.tensor([-3.0, 0.5, 9.0, 2.0])
    up = torch.tensor([-8.0, 0.25, 1.0, 12.0])
    g = torch.tensor([-3.0, 0.5, 7.0, 2.0])
    want = (torch.tensor([-7.0, 0.25, 1.0, 7.0]) + 1) * g * torch.sigmoid(1.702 * g)
    torch.testing.assert_close(swiglu_oai(gate, up, 1.702, 7.0), want)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_equal_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = YARN | {"truncate": truncate}
    config = GptOssConfig(head_dim=32, rope_parameters=params, max_position_embeddings=256)
    want, attn = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = yarn(10000.0, 32, 4.0, 64, truncate=truncate)
    torch.testing.assert_close(rope.inv_freq(), want, rtol=1e-6, atol=0)
    assert rope.attn_factor == pytest.approx(attn)
    plain = RopeConfig(10000.0, 32).inv_freq()
    assert torch.equal(rope.inv_freq()[:1], plain[:1])  # the fastest pair: kept
    torch.testing.assert_close(rope.inv_freq()[-4:], plain[-4:] / 4.0)  # the slow: interpolated


def test_yarn_on_another_family_matches_transformers(tmp_path):
    """YaRN is read for any family where transformers applies it (a Qwen3 with rope_scaling
    yarn, truncate left to its default)."""
    import json

    from tests.tiny_models import write_tiny_llama

    folder = write_tiny_llama(tmp_path / "qwen3", model_type="qwen3", head_dim=32, seed=3)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {k: YARN[k] for k in ("rope_type", "factor")} | {
        "original_max_position_embeddings": 16
    }
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(folder)
    assert loaded.config.rope.freq_factors == yarn(10000.0, 32, 4.0, 16).freq_factors
    ids = prompt(40, seed=8)
    want = reference(hf_reference(folder), ids)
    assert float((logits(loaded, ids) - want).abs().max()) < 1e-4 * float(want.abs().max())


def mxfp4_tensor(raw: bytes, n_blocks: int) -> GGUFTensor:
    from gguf import GGMLQuantizationType

    data = np.frombuffer(raw, dtype=np.uint8).reshape(1, 17 * n_blocks)
    return GGUFTensor("t", (32 * n_blocks,), GGMLQuantizationType.MXFP4, 0, len(raw), data)


def test_mxfp4_block_decodes_to_its_known_values():
    """ggml's block_mxfp4: one E8M0 scale byte e (2^(e - 127)), then 16 bytes whose low nibbles
    are values 0..15 and high nibbles values 16..31, each an E2M1 code: 0, .5, 1, 1.5, 2, 3, 4,
    6, and their negatives for codes 8..15."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    codes = [(3 * i + 1) % 16 for i in range(32)]
    qs = bytes(codes[j] | (codes[j + 16] << 4) for j in range(16))
    for e, scale in ((127, 1.0), (130, 8.0), (124, 0.125)):
        got = dequantize(mxfp4_tensor(bytes([e]) + qs, 1)).reshape(-1)
        np.testing.assert_array_equal(got, np.array([scale * e2m1[c] for c in codes], np.float32))


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(the float folder, the MXFP4 GGUF llama.cpp's converter writes from OpenAI's layout)."""
    float_dir, mxfp4_dir = write_tiny_gptoss_mxfp4(tmp_path_factory.mktemp("mxfp4"), seed=2)
    return float_dir, convert_with_llamacpp(mxfp4_dir, mxfp4_dir.parent / "mxfp4.gguf")


@pytest.mark.parametrize("blocks", [False, True])
def test_mxfp4_experts_from_the_converter_match_transformers(mxfp4, blocks):
    """The experts as ggml MXFP4 blocks (repacked by the converter from OpenAI's nibble
    order). Dequantized at load: transformers' logits and greedy tokens. With `blocks` every
    linear stays on the file's rows, the experts on their MXFP4 blocks (ggml_linear, int8
    activations per 32 as llama.cpp's q8_0): KL against transformers measured 0.002-0.004 over
    3 prompts (this random model's near-ties turn 5-18% of its argmaxes)."""
    from model.layers.ggml import BlockLinear
    from model.load.gguf import open_gguf

    float_dir, path = mxfp4
    types = {t.name: t.tensor_type.name for t in open_gguf(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.1.ffn_down_exps.weight"] == "MXFP4"
    if blocks and load_kernels() is None:
        pytest.skip("the C++ block kernels are not built")
    hf = hf_reference(float_dir)
    ids = prompt(40, seed=5)
    want = reference(hf, ids)
    loaded = load_model(path, blocks=blocks)
    got = logits(loaded, ids)
    if blocks:
        w13 = loaded.transformer.layers[1].feed_forward.experts[0].w13
        assert isinstance(w13, BlockLinear) and w13.types == [39, 39]  # gate | up, MXFP4
        lw = want.log_softmax(-1)
        assert float((lw.exp() * (lw - got.log_softmax(-1))).sum(-1).mean()) < 0.01
        return
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids[:12]]), max_new_tokens=12, do_sample=False)
    assert greedy(loaded, ids[:12], 12) == out[0, 12:].tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_one_call_step_runs_the_mxfp4_blocks(mxfp4, dtype, monkeypatch):
    """The experts on their MXFP4 blocks in step.cpp's MoE MLP: prompts past the window and
    decode steps in one call each, bit for bit the Python layers."""
    if not has_block_kernels(load_kernels()):
        pytest.skip("the C++ block kernels are not built")
    worker = make_worker(load_model(mxfp4[1], blocks=True, dtype=dtype), n_cells=512)
    assert worker.paths.native is not None, worker.paths.describe()
    calls = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    prompts = [prompt(9 + 5 * s, seed=s) for s in range(3)]
    native = decode(worker, prompts, steps=4)
    assert len(calls) == 4 + (worker.paths.prompt_attention is not None)
    worker.paths.native = None
    assert torch.equal(native, decode(worker, prompts, steps=4))


def test_the_server_answers_with_an_mxfp4_gguf(mxfp4):
    """The server's defaults for this CPU (model.load.loader.choose_runtime: a file this small
    is re-quantized, its MXFP4 experts to int4)."""
    import httpx

    from tests.live_server import start_server

    server = start_server(model=str(mxfp4[1]), n_cells=256)
    try:
        body = {"prompt": "Hello world", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        server.stop()


def test_an_unsupported_rope_scaling_is_refused_at_load(tmp_path):
    folder = write_tiny_gptoss(
        tmp_path / "hf", n_layers=2, rope_parameters=YARN | {"mscale": 1.0, "mscale_all_dim": 1.0}
    )
    with pytest.raises(ModelLoadError, match="mscale"):
        load_model(folder)


def test_a_quantized_folder_or_a_bad_expert_stack_is_refused_at_load(tmp_path):
    """The shapes as the file stores them (GptOssExperts' x @ W), naming the tensor."""
    import json

    from safetensors.torch import load_file, save_file

    folder = write_tiny_gptoss(tmp_path / "hf", n_layers=2)
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.1.mlp.experts.down_proj"
    tensors[name] = tensors[name][:, :16].contiguous()
    save_file(tensors, str(file))
    with pytest.raises(ModelLoadError, match=rf"{name} has shape \(4, 16, 64\), expected \(4, 32"):
        load_model(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized gpt-oss folder"):
        load_model(folder)
