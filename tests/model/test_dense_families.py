"""The dense families beyond Llama (Gemma 2, Phi-3, OLMo 2, Granite): tiny random models built by
transformers, against transformers (float32 logits, greedy decoding) from their HF folders and
their GGUFs in llama.cpp's layout (float, and Q8_0 on the file's own blocks), the one-call step
where it runs them, and the real scheduler."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from kvcache.cells import KVCells
from model import load_model
from model.kernels import load_kernels
from model.layers.ggml import BlockLinear, has_block_kernels
from model.layers.quant import quantize
from model.load.gguf import BLOCK_ARCHS
from model.load.loader import LoadedModel
from model.runner.native import NativeDecoder
from model.runner.worker import make_worker
from scheduler.plan import SamplingParams
from scheduler.request import Request
from tests.live_server import start_server
from tests.model.factories import Driver, make_plan, prefill_chunk, require_kernels
from tests.model.test_forward import place
from tests.model.test_moe import serve
from tests.model.test_native import decode, prompt_kernel_runs
from tests.tiny_dense import (
    DENSE_TYPES,
    GEMMA2_CAPS,
    GEMMA2_WINDOW,
    GRANITE_MULTIPLIERS,
    PHI3_MAX_CTX,
    PHI3_ORIG_CTX,
    write_tiny_dense,
    write_tiny_dense_gguf,
)

PROMPT = "Hello world! How are you today? The quick brown fox"


@pytest.fixture(scope="module", params=DENSE_TYPES)
def folder(request, tmp_path_factory):
    return write_tiny_dense(tmp_path_factory.mktemp(request.param) / "hf", request.param, seed=1)


@pytest.fixture(scope="module")
def gguf_path(folder):
    return write_tiny_dense_gguf(folder.parent / "model.gguf", folder)


@pytest.fixture(scope="module")
def hf_model(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def source(name: str, folder, gguf_path):
    return folder if name == "hf" else gguf_path


def logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    driver = Driver(make_worker(loaded, n_cells=128), 128)
    return driver.logits([driver.chunk(0, ids, all_rows=True)])


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


def greedy(loaded: LoadedModel, ids: list[int], n: int) -> list[int]:
    driver = Driver(make_worker(loaded, n_cells=128), 128, seed=1)
    tokens = driver.step([driver.chunk(0, ids)])
    while len(tokens) < n:
        tokens += driver.step([driver.chunk(0, [tokens[-1]])])
    return tokens


def greedy_request(i: int, ids: list[int]) -> Request:
    greedy_params = SamplingParams(temperature=0.0)
    return Request(f"r{i}", ids, max_tokens=10, ignore_eos=True, sampling=greedy_params)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 13 * seed) % 300 + 5 for i in range(n)]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_description_read_from_the_config_and_the_file(folder, gguf_path, fmt):
    args = load_model(source(fmt, folder, gguf_path)).config
    descs = [args.layer_desc(i) for i in range(args.n_layers)]
    if args.arch == "gemma2":  # layers 0 and 2 slide; caps; query_pre_attn_scalar = head_dim
        assert args.windows == (GEMMA2_WINDOW, 0) * 2 and args.attn_scale == 16**-0.5
        assert (args.attn_softcap, args.final_softcap) == tuple(GEMMA2_CAPS.values())
        assert descs[0].post_norms and descs[0].norm_shift == 1.0 and not descs[0].qk_norm
    elif args.arch == "phi3":  # the short factors until use_context asks for more
        lr = args.longrope
        assert lr is not None and lr.n_ctx_orig == PHI3_ORIG_CTX and args.rope is lr.short
        assert lr.short.freq_factors != lr.long.freq_factors
        assert abs(lr.long.attn_factor - math.sqrt(1 + math.log(4) / math.log(32))) < 1e-6
    elif args.arch in ("olmo2", "exaone4"):
        assert descs[0].qk_norm_full == (args.arch == "olmo2")
        assert descs[0].qk_norm and descs[0].post_norms and not descs[0].pre_norms
        assert "attn_norm" not in descs[0].weights and "ffn_norm" not in descs[0].weights
        assert not args.windows and all(d.rope is not None for d in descs)
    elif args.arch == "glm4":  # RoPE on half of each head, GLM's interleaved pairs
        assert args.qkv_bias and descs[0].post_norms and descs[0].pre_norms
        assert (args.rope.dim, args.rope.layout) == (8, "interleaved")
    else:
        assert args.arch == "granite"
        got = (args.embed_mult, args.residual_mult, args.attn_scale, args.logits_scaling)
        assert got == pytest.approx(tuple(GRANITE_MULTIPLIERS.values()))  # float32 in a GGUF


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_logits_match_transformers(folder, gguf_path, hf_model, fmt):
    """Float32, a prompt of 40 tokens (past Gemma 2's window of 8)."""
    ids = prompt(40, seed=2)[:PHI3_ORIG_CTX] if "phi3" in str(folder) else prompt(40, seed=2)
    want = reference(hf_model, ids)
    got = logits(load_model(source(fmt, folder, gguf_path)), ids)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_greedy_decoding_matches_transformers_generate(folder, gguf_path, hf_model, fmt):
    ids = prompt(11, seed=4)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert greedy(load_model(source(fmt, folder, gguf_path)), ids, 16) == out[0, 11:].tolist()


def test_gemma2_caps_bend_the_scores_and_the_logits(tmp_path):
    """Without the attention cap the logits move (the cap is not a no-op at this size); the
    final cap bounds them; query_pre_attn_scalar other than head_dim is read from the config."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_dense(tmp_path / "g", "gemma2", seed=3, query_pre_attn_scalar=24)
    loaded = load_model(folder)
    assert loaded.config.attn_scale == 24**-0.5
    ids = prompt(30, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = reference(hf, ids)
    got = logits(loaded, ids)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    assert float(got.abs().max()) <= GEMMA2_CAPS["final_logit_softcapping"]
    for layer in loaded.transformer.layers:
        layer.mixer.softcap = 0.0
    assert float((logits(loaded, ids) - want).abs().max()) > 1e-2


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_phi3_long_factors_past_the_original_context(folder, gguf_path, hf_model, fmt):
    """A context per sequence past original_max_position_embeddings takes the long factors
    (llama.cpp decides per context; transformers per forward, by its largest position: a
    prompt past 32 tokens rotates every position with the long ones); logits and greedy."""
    if "phi3" not in str(folder):
        pytest.skip("LongRoPE is Phi-3's")
    loaded = load_model(source(fmt, folder, gguf_path))
    short = loaded.config.rope
    loaded.config.use_context(PHI3_MAX_CTX)
    assert loaded.config.longrope is not None and loaded.config.rope is loaded.config.longrope.long
    ids = prompt(45, seed=6)
    want = reference(hf_model, ids)
    got = logits(loaded, ids)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert greedy(loaded, ids, 8) == out[0, len(ids) :].tolist()
    loaded.config.use_context(PHI3_ORIG_CTX)
    assert loaded.config.rope is short


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_phi3_sliding_window_on_every_layer(tmp_path, fmt):
    """Phi-3-mini's sliding_window (2047 of 4096): transformers' Phi3 slides every layer, and
    so does cellserve from the folder and from the GGUF (attention.sliding_window; llama.cpp
    reads it and turns it off). One window pool, prompts and decoding past it."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_dense(tmp_path / "hf", "phi3", seed=1, sliding_window=8)
    path = folder if fmt == "hf" else write_tiny_dense_gguf(tmp_path / "w.gguf", folder)
    loaded = load_model(path)
    assert loaded.config.windows == (8,) * 4
    assert [g.key for g in loaded.config.memory_spec.groups] == ["swa8"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt(30, seed=3)
    want = reference(hf, ids)
    assert float((logits(loaded, ids) - want).abs().max()) < 1e-4 * float(want.abs().max())
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids[:11]]), max_new_tokens=16, do_sample=False)
    assert greedy(loaded, ids[:11], 16) == out[0, 11:].tolist()
    prompts = [prompt(5, seed=0), prompt(20, seed=1)]
    together = serve(loaded, [greedy_request(i, p) for i, p in enumerate(prompts)])
    alone = serve(loaded, [greedy_request(1, prompts[1])])
    assert together.tokens[("r1", 0)] == alone.tokens[("r1", 0)]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_phi3_partial_rotary_with_longrope(tmp_path, fmt):
    """Phi-4-mini's shape: RoPE on half of each head (partial_rotary_factor; a GGUF's
    rope.dimension_count), the LongRoPE factors over those dims; short and long."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_dense(tmp_path / "hf", "phi3", seed=4, partial_rotary_factor=0.5)
    path = folder if fmt == "hf" else write_tiny_dense_gguf(tmp_path / "p.gguf", folder)
    loaded = load_model(path)
    assert loaded.config.rope.dim == 8 and loaded.config.longrope is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for n, n_ctx in ((PHI3_ORIG_CTX, PHI3_ORIG_CTX), (45, PHI3_MAX_CTX)):
        loaded.config.use_context(n_ctx)
        ids = prompt(n, seed=9)
        want = reference(hf, ids)
        got = logits(loaded, ids)
        assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())


def test_exaone4_window_and_nope_on_the_global_layers(tmp_path):
    """EXAONE 4.0 32B's shape (HF): layers 0-2 slide, layer 3 is global and takes no RoPE; the
    prompt and the greedy decoding pass the window. (llama.cpp slides only a 64-layer exaone4
    GGUF, so a tiny windowed one is not compared.)"""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_dense(tmp_path / "hf", "exaone4", seed=5, sliding_window=8)
    loaded = load_model(folder)
    assert loaded.config.windows == (8, 8, 8, 0)
    assert [loaded.config.layer_desc(i).rope is None for i in range(4)] == [False] * 3 + [True]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt(30, seed=3)
    want = reference(hf, ids)
    assert float((logits(loaded, ids) - want).abs().max()) < 1e-4 * float(want.abs().max())
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids[:11]]), max_new_tokens=16, do_sample=False)
    assert greedy(loaded, ids[:11], 16) == out[0, 11:].tolist()


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_bfloat16_is_close_to_float32(folder, gguf_path, fmt):
    path = source(fmt, folder, gguf_path)
    ids = prompt(20, seed=1)
    full, half = logits(load_model(path), ids), logits(load_model(path, dtype="bfloat16"), ids)
    assert float((full - half).abs().max()) < 0.05 * float(full.max() - full.min())
    assert float((full.argmax(-1) == half.argmax(-1)).float().mean()) >= 0.9


def test_q8_0_gguf_on_its_own_blocks_matches_transformers(folder, hf_model):
    """--quant gguf: the Q8_0 file's linears on their blocks (Phi-3's fused attn_qkv and ffn_up
    split into row ranges of the mapping: views), against transformers within Q8_0's rounding
    and against the same file dequantized."""
    arch = load_model(folder).config.arch  # model_type = llama.cpp's name for these four
    assert arch in BLOCK_ARCHS
    if not has_block_kernels(load_kernels()):
        pytest.skip("the C++ block kernels are not built")
    path = write_tiny_dense_gguf(folder.parent / "q8.gguf", folder, qtype="Q8_0")
    ids = prompt(30, seed=7)
    want = reference(hf_model, ids)
    blocks = load_model(path, blocks=True)
    wqkv = blocks.transformer.layers[0].mixer.wqkv
    assert isinstance(wqkv, BlockLinear)
    if arch == "phi3":  # three views of one attn_qkv mapping, in order
        ptrs = [p.data_ptr() for p in wqkv.parts]
        assert ptrs == sorted(ptrs) and all(w.mapped for w in wqkv.weights)
    got, dense = logits(blocks, ids), logits(load_model(path), ids)
    for ours in (got, dense):
        assert_close_to_q8_0(ours, want)


def assert_close_to_q8_0(got: torch.Tensor, want: torch.Tensor) -> None:
    """The stated tolerance of a Q8_0 file against float32 transformers on these tiny random
    models: every logit within 8% of the reference's spread (measured: at most 5.8%, Gemma 2's
    blocks, whose sqrt(dim)-scaled embeddings are Q8_0 too; 0.4-3% for the others), and each
    row's argmax at most that far below the reference's top logit (random tiny models have
    near-ties; an argmax that differs must be one)."""
    tol = 0.08 * float(want.max() - want.min())
    assert float((got - want).abs().max()) < tol
    picked = want.gather(-1, got.argmax(-1, keepdim=True))[:, 0]
    assert float((want.amax(-1) - picked).max()) < tol


# the one-call step: sizes its kernels take (int4 groups of 32, head_dim 32)
NATIVE_SIZES = dict(dim=128, n_heads=4, n_kv_heads=2, hidden_dim=256)


# The families as the one-call step takes them: (model_type, write_tiny_dense's overrides)
NATIVE_FAMILIES = {
    "phi3": ("phi3", {}),  # LongRoPE's factors and attention factor in the RoPE tables
    "phi3_partial": ("phi3", {"partial_rotary_factor": 0.5}),  # rotate-half on half a head
    "granite": ("granite", {}),  # the multipliers
    "gemma2": ("gemma2", {}),  # capped scores, windows of 8 on layers 0 and 2, post norms
    "olmo2": ("olmo2", {}),  # no pre-norms, q/k norms over the whole projection
    "exaone4": ("exaone4", {}),  # no pre-norms, q/k norms per head
    "exaone4_swa": ("exaone4", {"sliding_window": 8}),  # LLLG, NoPE on the global layer
    "glm4": ("glm4", {}),  # interleaved RoPE on half of each head, q/k/v biases
}


@pytest.mark.parametrize(
    "family, dtype, quant, n_seq",
    [
        (m, d, q, n)
        for m in NATIVE_FAMILIES
        for d in ("bfloat16", "float32")
        for q, n in (("int4", 1), ("int4", 10), ("int8", 3), ("gguf", 3))
    ],
)
def test_the_one_call_step_runs_each_family_as_the_python_layers(
    tmp_path, family, dtype, quant, n_seq, monkeypatch
):
    """Each family from its description alone: bit for bit the Python layers' logits, which
    call the same kernels (Gemma 2's capped scores included), for prompts of 9 to 54 tokens
    and decode steps past the windows of 8, one sequence and several together."""
    require_kernels()
    model_type, overrides = NATIVE_FAMILIES[family]
    folder = write_tiny_dense(tmp_path / family, model_type, seed=2, **NATIVE_SIZES, **overrides)
    if quant == "gguf":
        if family == "exaone4_swa":
            pytest.skip("llama.cpp's exaone4 GGUF slides only at 64 layers (see above)")
        path = write_tiny_dense_gguf(tmp_path / "m.gguf", folder, qtype="Q8_0")
        loaded = load_model(path, dtype=dtype, blocks=True)
    else:
        loaded = load_model(folder, dtype=dtype)
        quantize(loaded.transformer, quant)
    worker = make_worker(loaded, n_cells=512)
    assert worker.paths.native is not None, worker.paths.describe()
    assert worker.paths.decode_attention is not None  # Gemma 2 too: the kernels cap
    steps = worker.paths.native.layers_
    if family in ("glm4", "phi3_partial"):  # half of each head of 32: step.cpp rope_partial_
        assert {(s.rope_dim, s.rope_interleaved) for s in steps} == {(16, family == "glm4")}
    assert all((s.attn_norm is None) == (model_type in ("olmo2", "exaone4")) for s in steps)
    assert all(s.softcap == (2.0 if family == "gemma2" else 0.0) for s in steps)
    prompts = [prompt(9 + 5 * s, seed=s) for s in range(n_seq)]
    calls = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = decode(worker, prompts, steps=6)
    # prompts longer than a window too: the prompt kernel reads each row's window
    assert len(calls) == 6 + prompt_kernel_runs(worker)
    worker.paths.native = None
    assert torch.equal(native, decode(worker, prompts, steps=6))


def test_concurrent_requests_through_the_scheduler_each_equal_alone(folder):
    """The real scheduler mixes prompt chunks and decodes (and, for Gemma 2, the iSWA memory's
    two pools); each request's greedy tokens are the ones it gets alone."""
    loaded = load_model(folder)
    loaded.config.use_context(256)  # serve(): 256 tokens a sequence (Phi-3: the long factors)
    check_together_equals_alone(loaded)


def check_together_equals_alone(loaded: LoadedModel) -> None:
    """Four prompts (3 to 90 tokens) served together and each alone: the same 10 tokens."""
    prompts = [prompt(n, seed=i) for i, n in enumerate([3, 30, 90, 12])]
    together = serve(loaded, [greedy_request(i, p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        alone = serve(loaded, [greedy_request(i, p)])
        assert together.tokens[(f"r{i}", 0)] == alone.tokens[(f"r{i}", 0)], i
        assert len(alone.tokens[(f"r{i}", 0)]) == 10


def test_the_server_answers_with_each_family(folder):
    """The Q8_0 GGUF with the server's defaults for this CPU (model.load.loader.choose_runtime);
    a completion and a chat turn."""
    path = write_tiny_dense_gguf(folder.parent / "served.gguf", folder, qtype="Q8_0")
    server = start_server(model=str(path), n_cells=256)
    try:
        body = {"prompt": "Hello world", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    finally:
        server.stop()


def test_shifted_sequence_equals_fresh_prefill_at_new_positions(folder):
    """The K-shift re-rotates stored K with the layer's own RoPE (Phi-3: the long factors, the
    attention factor applied once at the write, not again by the shift): a prompt prefilled at
    60.. and shifted by -60 continues as one prefilled at 0.. (Gemma 2's iSWA pools shift as
    Gemma 3's do: tests/model/test_gemma3.py)."""
    loaded = load_model(folder)
    if loaded.config.windows:
        pytest.skip("sliding-window layers: tests/model/test_gemma3.py")
    loaded.config.use_context(PHI3_MAX_CTX)  # Phi-3: the long factors
    worker = make_worker(loaded, n_cells=128)
    cells = KVCells(n_cells=128, n_seq_max=2)
    ids, nxt = prompt(30, seed=8), 42
    worker.execute(make_plan([place(cells, 0, ids, list(range(60, 90)))]))
    cells.seq_add(0, -1, -1, -60)
    shifted = worker.forward(make_plan([place(cells, 0, [nxt], [30])], cells.take_pending()))
    fresh = make_worker(loaded, n_cells=128)
    ref = fresh.forward(make_plan([prefill_chunk(0, ids + [nxt], 0)]))
    assert float((shifted - ref).abs().max()) < 1e-4 * float(ref.abs().max())
