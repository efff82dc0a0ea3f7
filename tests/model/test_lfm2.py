"""LFM2 (Lfm2ForCausalLM: gated short convolutions over state slots beside GQA attention with
q/k norms) against transformers, from the Hugging Face folder and from the GGUF that llama.cpp's
own converter writes of it (tests/llamacpp_convert.py), and against llama-server on that GGUF;
a random model with every weight redrawn (tests/tiny_ssm.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import types
from dataclasses import replace

import httpx
import pytest
import torch

from bench.server_proc import llama_server, llamacpp_default
from model import load_model
from model.errors import ModelLoadError
from model.kernels import load_kernels
from model.layers.ggml import has_block_kernels
from model.layers.quant import quantize
from model.runner.native import NativeDecoder
from model.runner.worker import make_worker
from tests.live_server import start_server_process
from tests.llamacpp_convert import convert_with_llamacpp, require_llamacpp
from tests.llamacpp_server import assert_same_next_token_logprobs
from tests.model.state_driver import (
    Chunk,
    StateDriver,
    assert_close,
    greedy,
    hf_greedy,
    mixed_steps,
    prompt,
)
from tests.tiny_ssm import LFM2_LAYERS, write_tiny_lfm2

pytestmark = pytest.mark.model

# next-token log-probabilities against llama-server, measured 2026-12-05 (worst of the top 5 over
# 8 prompts of 5-47 tokens): F32 0.0013 (llama.cpp keeps K/V in float16); Q8_0 (llama-quantize)
# on its own blocks 0.11, Q4_K_M 0.15 (its small rows fall back to Q5_0 / Q8_0), the same files
# dequantized with float activations 0.18 / 0.23: llama.cpp's int8 activations move these small
# random models that much, where a misread block or a conv state off by a token moves them by
# whole units (logits spread ~10)
LLAMA_CPP_TOLERANCE = {"F32": 0.01, "Q8_0": 0.2, "Q4_K_M": 0.3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_lfm2(tmp_path_factory.mktemp("lfm2") / "hf", seed=4)


@pytest.fixture(scope="module")
def hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_path(folder):
    # LFM2's GGUFs name their pre-tokenizer "lfm2" (llama.cpp: Llama 3's regex)
    return convert_with_llamacpp(folder, folder.parent / "lfm2.gguf", pre="lfm2")


@pytest.fixture(scope="module", params=["hf", "gguf"])
def tiny(request, folder):
    if request.param == "hf":
        return load_model(folder)
    return load_model(request.getfixturevalue("gguf_path"))


def driver(tiny, n_cells: int = 512, n_slots: int = 8) -> StateDriver:
    worker = make_worker(tiny, n_cells=n_cells, group_cells=[n_cells, n_slots])
    return StateDriver(worker, n_cells, n_slots)


def test_description_read_from_the_folder_and_the_gguf(folder, gguf_path):
    args = load_model(folder).config
    assert args.mixers == tuple(
        "attn" if t == "full_attention" else "shortconv" for t in LFM2_LAYERS
    )
    assert (args.short_conv, args.hidden_dim, args.head_dim) == (3, 128, 16)  # 160 * 2/3 -> 128
    assert args.block.qk_norm and not args.block.qk_norm_full
    assert args.layer_desc(0).weights[:4] == (
        "attn_norm",
        "shortconv_in",
        "shortconv_conv",
        "shortconv_out",
    )
    assert [g.key for g in args.memory_spec.groups] == ["full", "recurrent"]
    from_gguf = load_model(gguf_path).config
    assert from_gguf == replace(args, norm_eps=from_gguf.norm_eps)  # float32 in the GGUF
    worker = make_worker(load_model(folder), n_cells=32, group_cells=[32, 4])
    assert worker.kv_bytes_per_cell == 2 * 2 * 2 * 16 * 4  # 2 attention layers, K and V
    assert worker.state_bytes_per_slot == 3 * 64 * 2 * 4  # 3 conv layers x [dim, L - 1]
    reason = NativeDecoder.build(worker.model, worker.storage, types.SimpleNamespace())[1]
    # float weights (the float32 reference) keep it in Python, not its short convolutions
    assert "float weights" in reason  # what the start-up line says


def test_released_config_keys_read_alike(folder, tmp_path):
    """LFM2's published config.json predates transformers' names: full_attn_idxs instead of
    layer_types, block_ff_dim, tie_embedding, a top-level rope_theta."""
    config = json.loads((folder / "config.json").read_text())
    for key in ("layer_types", "intermediate_size", "tie_word_embeddings", "rope_parameters"):
        config.pop(key)
    attn = [i for i, t in enumerate(LFM2_LAYERS) if t == "full_attention"]
    config |= {"full_attn_idxs": attn, "block_ff_dim": 160, "tie_embedding": True}
    config |= {"rope_theta": 1000000.0}
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    (legacy / "config.json").write_text(json.dumps(config))
    old, new = load_model(legacy), load_model(folder)
    assert old.config == new.config
    ids = prompt(20, seed=10)
    assert torch.equal(driver(old).logits([Chunk(0, ids)]), driver(new).logits([Chunk(0, ids)]))
    (legacy / "config.json").write_text(json.dumps(config | {"conv_bias": True}))
    with pytest.raises(ModelLoadError, match="conv_bias"):
        load_model(legacy)


def test_gguf_weights_are_the_folders(folder, gguf_path):
    ours = load_model(gguf_path).transformer.state_dict()
    want = load_model(folder).transformer.state_dict()
    assert sorted(ours) == sorted(want)
    for name, w in want.items():
        assert torch.equal(ours[name], w), name


@pytest.mark.parametrize("n", [2, 300])
def test_prompt_logits_match_transformers(tiny, hf, n):
    ids = prompt(n, seed=n)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close(driver(tiny).logits([Chunk(0, ids, all_rows=True)]), ref, rel=1e-5)


def test_greedy_decode_matches_transformers(tiny, hf):
    ids = prompt(40, seed=5)
    ref_tokens, ref = hf_greedy(hf, ids, 16)
    tokens, ours = greedy(driver(tiny), 0, ids, 16)
    assert_close(ours, ref, rel=1e-5)
    assert tokens == ref_tokens


@pytest.mark.parametrize("size", [1, 2, 7])
def test_prefill_in_chunks_equals_one_prefill(tiny, size):
    """Chunks shorter than the conv's window (L - 1 = 2) take the rest of it from the state."""
    ids = prompt(45, seed=2)
    whole = driver(tiny)
    ref = whole.logits([Chunk(0, ids)])
    parts = driver(tiny)
    for lo in range(0, len(ids), size):
        ours = parts.logits([Chunk(0, ids[lo : lo + size])])
    assert_close(ours, ref, rel=1e-5)
    assert_close(parts.logits([Chunk(0, [7, 8])]), whole.logits([Chunk(0, [7, 8])]), rel=1e-5)


def alone(tiny, steps: list[list[int]]) -> torch.Tensor:
    """One sequence on its own worker: each chunk in a step of its own -> the last logits."""
    d = driver(tiny, n_cells=128)
    for chunk in steps:
        out = d.logits([Chunk(0, chunk)])
    return out


def test_batched_sequences_fork_and_abort_keep_their_own_state(tiny):
    """Sequences of different lengths batched together, decode rows beside a prompt chunk, a
    fork (cells shared, conv state copied) and an aborted sequence whose slot a new one takes
    (zeroed): every sequence's logits are its own run's."""
    d = driver(tiny)
    p = {s: prompt(n, seed=s) for s, n in enumerate([3, 30, 9, 50, 20])}
    d.logits([Chunk(s, p[s]) for s in range(3)])
    d.fork(1, 4)
    step2 = [Chunk(0, [40]), Chunk(1, [41]), Chunk(2, [42]), Chunk(3, p[3]), Chunk(4, [99])]
    together = d.logits(step2)
    d.free_slots.append(d.slot.pop(2))  # seq 2 aborted: its slot is the next one handed out
    step3 = [Chunk(0, [50]), Chunk(5, p[4]), Chunk(1, [51]), Chunk(3, [53]), Chunk(4, [54])]
    after = d.logits(step3)
    assert d.slot[5] not in [d.slot[s] for s in (0, 1, 3, 4)]
    refs2 = [[p[0], [40]], [p[1], [41]], [p[2], [42]], [p[3]], [p[1], [99]]]
    for row, steps in enumerate(refs2):
        assert_close(together[row : row + 1], alone(tiny, steps), rel=1e-5)
    refs3 = [[p[0], [40], [50]], [p[4]], [p[1], [41], [51]], [p[3], [53]], [p[1], [99], [54]]]
    for row, steps in enumerate(refs3):
        assert_close(after[row : row + 1], alone(tiny, steps), rel=1e-5)


def test_capture_resumes_like_a_prefix_prefill(tiny):
    """A prefix-cache checkpoint: the conv state after the first 33 rows, copied mid-chunk."""
    ids = prompt(80, seed=3)
    d = driver(tiny)
    d.free_slots = [0, 1]  # the sequence takes slot 1; the capture goes to slot 0
    d.logits([Chunk(0, ids, captures=[(33, 0)])])
    ref = driver(tiny)
    ref.logits([Chunk(0, ids[:33])])
    d.resume(1, 0, 33, d.cells[0][:33])
    nxt = ids[33:40]
    assert_close(d.logits([Chunk(1, nxt, all_rows=True)]), ref.logits([Chunk(0, nxt, True)]))


@pytest.mark.parametrize("mode", ["int8", "bfloat16", "batch-invariant"])
def test_quantized_bfloat16_and_padded_steps_stay_close(folder, mode):
    """quantize() swaps the short convs' in/out projections like any Linear; a bfloat16 model
    keeps its conv state in bfloat16; --batch-invariant pads steps with rows of no sequence.
    KL measured: int8 0.003, bfloat16 0.0005, padded 1e-8. int4 moves this random model by
    0.2 (the quantized kernels are the shared ones, tested with the families that use them)."""
    ref_model = load_model(folder)
    ids = prompt(40, seed=6)
    ref = driver(ref_model).logits([Chunk(0, ids, all_rows=True)]).log_softmax(-1)
    tiny = load_model(folder, dtype="bfloat16" if mode == "bfloat16" else "float32")
    if mode.startswith("int"):
        quantize(tiny.transformer, mode)
        assert type(tiny.transformer.layers[0].mixer.in_proj).__name__ == "QuantLinear"
    d = driver(tiny)
    if mode == "batch-invariant":
        d = StateDriver(make_worker(tiny, 128, group_cells=[128, 4], batch_invariant=True), 128, 4)
    ours = torch.cat(
        [d.logits([Chunk(0, ids[:25], all_rows=True)])]
        + [d.logits([Chunk(0, [t])]) for t in ids[25:]]
    )
    kl = float((ref.exp() * (ref - ours.float().log_softmax(-1))).sum(-1).mean())
    assert kl < {"int8": 0.01, "bfloat16": 0.005, "batch-invariant": 1e-6}[mode], kl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_kernel_is_the_torch_scan(dtype):
    """kernels.short_conv against ShortConvMixer's torch ops: two decode rows (not in batch
    order) and two prompt chunks (one with captures at rows 1 and 5) over their slots; rows in
    no group stay 0; the states moved (and the captures written) alike; bad slots refused."""
    from model.layers.batch import StateBatch, StatePrompt
    from model.layers.shortconv import ShortConvMixer

    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "short_conv"):
        pytest.skip("no C++ kernels built for this CPU")
    gen = torch.Generator().manual_seed(0)
    n, d, L, n_slots = 16, 96, 4, 8
    v = torch.randn(n, d, generator=gen).to(dtype)
    weight = torch.randn(d, L, generator=gen).to(dtype)
    conv = torch.randn(n_slots, d, L - 1, generator=gen).to(dtype)
    prompts = [StatePrompt(3, 10, 5, [(1, 6), (5, 0)]), StatePrompt(10, 15, 2)]
    sb = StateBatch(torch.tensor([2, 0]), torch.tensor([7, 1]), prompts)
    mixer = ShortConvMixer.__new__(ShortConvMixer)
    torch.nn.Module.__init__(mixer)
    mixer.conv_w = torch.nn.Parameter(weight.double(), requires_grad=False)  # the reference
    want_conv, want = conv.double(), torch.zeros(n, d, dtype=torch.float64)
    vd = v.double()
    want[sb.decode_rows] = mixer._step(vd[sb.decode_rows], want_conv, sb.decode_slots)
    for sp in prompts:
        want[sp.start : sp.end] = mixer._scan(vd[sp.start : sp.end], want_conv, sp)
    got = kernels.short_conv(v, conv, weight, sb.native_state(kernels))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol * 10, rtol=tol)
    assert not got[[1, 15]].any()  # rows in no group
    assert torch.equal(conv.double(), want_conv)  # the states hold v's own values
    bad = StateBatch(torch.tensor([0]), torch.tensor([n_slots]), [])
    with pytest.raises(RuntimeError, match="decode slot 8 is not in"):
        kernels.short_conv(v, conv, weight, bad.native_state(kernels))


@pytest.fixture(scope="module")
def kernel_sized(tmp_path_factory):
    """The tiny LFM2 at sizes the C++ step takes (int4 groups of 32, head_dim 32)."""
    return write_tiny_lfm2(tmp_path_factory.mktemp("lfm2k") / "hf", dim=128, seed=5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quant", ["int4", "int8", "gguf"])
def test_the_one_call_step_runs_lfm2_as_the_python_layers(kernel_sized, dtype, quant, monkeypatch):
    """The short convolutions in step.cpp (short_conv, the op the Python layers call too):
    every step of sequences batched together (prompt chunks beside decode rows, a fork, a
    capture mid-chunk resumed by a new sequence) runs in one call and gives the Python layers'
    logits bit for bit."""
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("no C++ kernels built for this CPU")
    if quant == "gguf":
        if not has_block_kernels(kernels):
            pytest.skip("a build without ggml_linear")
        path = convert_with_llamacpp(
            kernel_sized, kernel_sized.parent / "lfm2-q8.gguf", pre="lfm2", outtype="q8_0"
        )
        loaded = load_model(path, dtype=dtype, blocks=True)
    else:
        loaded = load_model(kernel_sized, dtype=dtype)
        quantize(loaded.transformer, quant)
    worker = make_worker(loaded, n_cells=512, group_cells=[512, 8])
    assert worker.paths.native is not None, worker.paths.describe()
    calls: list[int] = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = mixed_steps(worker, (3, 30, 9, 50, 20))
    # the 3 steps with prompt chunks where this build has the prompt kernel, the 4 decode steps
    assert len(calls) == 4 + 3 * (worker.paths.prompt_attention is not None)
    worker.paths.native = None
    assert torch.equal(native, mixed_steps(worker, (3, 30, 9, 50, 20)))


TEXTS = ["It is 0123456789 now! It's 12 o'clock.", "  two  spaces\n\nlines", "x=3.1; I'M ok"]


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K_M"])
def test_llama_cpp_gives_the_same_next_token_logprobs(gguf_path, tmp_path, qtype):
    """And the same token ids: "lfm2" is Llama 3's pre-tokenizer (digits in threes, ...). A
    quantized file runs on its own blocks, the short convs' projections included."""
    binary = require_llamacpp(llamacpp_default())
    path = gguf_path
    if qtype != "F32":
        if not has_block_kernels(load_kernels()):
            pytest.skip("the C++ block kernels are not built")
        quantize_tool = require_llamacpp(binary.parent / "llama-quantize")
        path = tmp_path / f"lfm2-{qtype}.gguf"
        subprocess.run([str(quantize_tool), str(gguf_path), str(path), qtype, "1"], check=True,
                       capture_output=True)  # fmt: skip
    tiny = load_model(path, blocks=qtype != "F32")
    if qtype != "F32":
        assert type(tiny.transformer.layers[0].mixer.in_proj).__name__ == "BlockLinear"
    tolerance = LLAMA_CPP_TOLERANCE[qtype]
    with llama_server(binary, path, tmp_path / "llama.log", n_threads=1) as served:
        for text in TEXTS:
            body = {"content": text, "add_special": False}
            want = httpx.post(f"{served.url}/tokenize", json=body, timeout=60).json()["tokens"]
            assert tiny.tokenizer.encode(text) == want, text
    prompts = [prompt(5 + 6 * seed, seed=20 + seed) for seed in range(8)]
    assert_same_next_token_logprobs(
        binary, path, tmp_path / "llama.log", prompts,
        lambda _, ids: driver(tiny, n_cells=64).logits([Chunk(0, ids)])[0],
        tolerance, exact_argmax=False,
    )  # fmt: skip


def test_cli_serves_the_gguf(gguf_path):
    server = start_server_process(
        "--model", str(gguf_path), "--n-cells", "256", "--dtype", "float32", "--quant", "none"
    )
    try:
        body = {"model": "lfm2", "prompt": "Hello world", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        chat = {"model": "lfm2", "messages": [{"role": "user", "content": "Hi"}]}
        chat |= {"max_tokens": 6, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert s.status_code == 200 and lines[-1] == "data: [DONE]"
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'cellserve_state_slot_bytes{pool="recurrent"} 1536.0' in metrics
    finally:
        server.stop()
        server.log.close()
