"""Mixture-of-experts models (model/layers/moe.py): tiny random Qwen3-MoE, OLMoE, GraniteMoE and
Mixtral built by transformers, against transformers (logits, greedy decoding), through their GGUFs
(float, and on the file's own Q8_0 / Q4_0 blocks), int4 experts, the real scheduler, and the
real server."""

from __future__ import annotations

import ctypes
import random

import httpx
import pytest
import torch

from model import load_model
from model.errors import ModelLoadError
from model.kernels import load_kernels
from model.layers.ggml import BlockLinear, has_block_kernels
from model.layers.moe import MoEFeedForward
from model.layers.quant import QuantLinear, dequantize_int4, quantize, quantize_int4
from model.load.loader import LoadedModel
from model.runner.native import NativeDecoder
from model.runner.worker import make_worker
from scheduler.plan import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.live_server import start_server
from tests.model.factories import Driver, make_plan, prefill_chunk, require_kernels
from tests.model.test_native import decode, prompt_kernel_runs
from tests.scheduler.fakes import Outcome, make_config, make_prompt, step
from tests.tiny_moe import GRANITE_MULTIPLIERS, write_tiny_moe, write_tiny_moe_gguf

PROMPT = "Hello world! How are you today? The quick brown fox"
MOE_TYPES = ["qwen3_moe", "olmoe", "granitemoe", "mixtral", "qwen2_moe", "granitemoeshared"]


@pytest.fixture(scope="module", params=MOE_TYPES)
def folder(request, tmp_path_factory):
    return write_tiny_moe(tmp_path_factory.mktemp(request.param) / "hf", request.param, seed=1)


@pytest.fixture(scope="module")
def hf_model(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    worker = make_worker(loaded, n_cells=128)
    return worker.forward(make_plan([prefill_chunk(0, ids, 0, all_rows=True)]))


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


def test_description_read_from_the_config(folder):
    args = load_model(folder).config
    assert args.moe is not None and (args.moe.n_experts, args.moe.n_used) == (8, 2)
    assert args.moe.expert_dim == 32
    # OLMoE does not renormalize, nor does Qwen2-MoE's config here (llama.cpp never does)
    assert args.moe.norm_topk_prob == (args.arch not in ("olmoe", "qwen2_moe"))
    assert args.moe.shared_dim == (64 if args.arch in ("qwen2_moe", "granitemoeshared") else 0)
    assert args.moe.shared_gate == (args.arch == "qwen2_moe")
    # Llama's and Qwen2's blocks: no q/k norms
    llama_block = ("granitemoe", "granitemoeshared", "mixtral", "qwen2_moe")
    assert args.block.qk_norm == (args.arch not in llama_block)
    assert args.block.qk_norm_full == (args.arch == "olmoe")
    assert all(args.layer_desc(i).moe for i in range(args.n_layers))
    if args.arch.startswith("granitemoe"):
        got = (args.embed_mult, args.residual_mult, args.attn_scale, args.logits_scaling)
        assert got == tuple(GRANITE_MULTIPLIERS.values())


def test_logits_match_transformers(folder, hf_model):
    loaded = load_model(folder)
    ids = loaded.tokenizer.encode(PROMPT)
    want = reference(hf_model, ids)
    assert float((logits(loaded, ids) - want).abs().max()) < 1e-4 * float(want.abs().max())
    layer = loaded.transformer.layers[0].feed_forward
    assert isinstance(layer, MoEFeedForward)
    assert int(layer.expert_rows.sum()) == len(ids) * 2  # every row took 2 experts


def test_a_mixtral_with_a_sliding_window_is_refused(tmp_path):
    """MixtralForCausalLM masks to sliding_window where the config sets one; cellserve runs
    Llama's block with full attention, so such a config is refused, not served wrongly."""
    folder = write_tiny_moe(tmp_path / "hf", "mixtral", sliding_window=16)
    with pytest.raises(ModelLoadError, match="sliding-window attention"):
        load_model(folder)


def test_more_experts_a_token_than_experts_is_refused(tmp_path):
    """num_experts_per_tok outside 1..num_experts: refused at load (torch.topk would raise at
    the first request), from config.json and from a GGUF's expert_used_count."""
    import json

    from tests.model.test_gguf_ssm_refusals import rewrite

    folder = write_tiny_moe(tmp_path / "hf", "qwen3_moe")
    path = write_tiny_moe_gguf(tmp_path / "m.gguf", folder)
    bad = rewrite(path, tmp_path / "bad.gguf", set_kv={"qwen3moe.expert_used_count": 9})
    with pytest.raises(ModelLoadError, match="9 experts used a token of 8"):
        load_model(bad)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_experts_per_tok": 0}))
    with pytest.raises(ModelLoadError, match="0 experts used a token of 8"):
        load_model(folder)


def test_dense_layers_between_sparse_ones_match_transformers(tmp_path):
    """Qwen3-MoE's mlp_only_layers: layer 1 of 3 is a dense MLP of intermediate_size."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_moe(tmp_path / "mixed", n_layers=3, mlp_only_layers=[1], seed=2)
    loaded = load_model(folder)
    assert [loaded.config.layer_desc(i).moe for i in range(3)] == [True, False, True]
    ids = loaded.tokenizer.encode(PROMPT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = reference(hf, ids)
    assert float((logits(loaded, ids) - want).abs().max()) < 1e-4


def assert_mostly_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The stated tolerance of a rounded path (bfloat16, quantized weights or activations): 90%
    of the rows within 5% of the largest logit, 90% of the argmaxes equal. A row past it is one
    whose rounding flipped an expert choice (routing is discontinuous), which moves that row
    by more; a dense model's rows all move a little instead."""
    row_err = (got - want).abs().amax(-1) / float(want.abs().max())
    assert float((row_err < 0.05).float().mean()) >= 0.9, row_err
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_bfloat16_is_close_to_float32(folder):
    """The default activations where the CPU computes bfloat16 (the fused norms and SiLU-mul
    kernels in the experts)."""
    ids = load_model(folder).tokenizer.encode(PROMPT)
    full, half = logits(load_model(folder), ids), logits(load_model(folder, dtype="bfloat16"), ids)
    assert_mostly_close(half, full)


def test_greedy_decoding_matches_transformers_generate(folder, hf_model):
    ids = make_prompt(11, seed=4)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    driver = Driver(make_worker(load_model(folder), n_cells=64), 64, seed=1)
    tokens = driver.step([driver.chunk(0, ids)])
    while len(tokens) < 16:
        tokens += driver.step([driver.chunk(0, [tokens[-1]])])
    assert tokens == out[0, len(ids) :].tolist()


def test_float_gguf_matches_transformers(folder, hf_model, tmp_path):
    """llama.cpp's layout: ffn_gate_inp and the experts stacked [n_expert, out, in], through
    the dequantizing loader and (F32 rows) on the file's own blocks, one expert a view."""
    path = write_tiny_moe_gguf(tmp_path / "moe.gguf", folder)
    loaded = load_model(path)
    ids = loaded.tokenizer.encode(PROMPT)
    want = reference(hf_model, ids)
    tol = 1e-4 * float(want.abs().max())
    assert float((logits(loaded, ids) - want).abs().max()) < tol
    if has_block_kernels(load_kernels()):
        blocks = load_model(path, blocks=True)
        expert = blocks.transformer.layers[0].feed_forward.experts[3].w13
        assert isinstance(expert, BlockLinear) and expert.out_features == 2 * 32
        assert float((logits(blocks, ids) - want).abs().max()) < tol


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_gguf_blocks_match_its_dequantized_weights(folder, tmp_path, qtype):
    """The file's own blocks (int8 activations per 32, as llama.cpp) against the same weights
    dequantized to float32, within assert_mostly_close's tolerance."""
    if not has_block_kernels(load_kernels()):
        pytest.skip("the C++ block kernels are not built")
    path = write_tiny_moe_gguf(tmp_path / f"moe-{qtype}.gguf", folder, qtype=qtype)
    dense = load_model(path)
    ids = dense.tokenizer.encode(PROMPT)
    want = logits(dense, ids)
    assert_mostly_close(logits(load_model(path, blocks=True), ids), want)


def naive_moe(layer: MoEFeedForward, x: torch.Tensor, experts: list, shared=None) -> torch.Tensor:
    """Row by row, slot by slot: sum_j w_j * expert_j(x) with `experts` callables, plus
    shared(x) with a shared expert (`shared` its callable), times sigmoid(g . x) where it is
    gated (Qwen2-MoE)."""
    top, idx = layer.route(x)
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for j in range(idx.shape[1]):
            out[r] += top[r, j] * experts[int(idx[r, j])](x[r : r + 1])[0]
        if layer.shared is not None:  # gated (Qwen2-MoE) or not (GraniteMoeShared)
            g = layer.shared_gate
            gate = 1.0 if g is None else torch.sigmoid(x[r] @ g[0])
            out[r] += gate * shared(x[r : r + 1])[0]
    return out


def shared_of(layer: MoEFeedForward, weights=lambda w: w):
    """The layer's shared expert as a dense callable (None without one)."""
    s = layer.shared
    return None if s is None else dense_expert(weights(s.w13.weight), weights(s.w2.weight))


def dense_expert(w13: torch.Tensor, w2: torch.Tensor):
    def run(x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ w13.T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ w2.T

    return run


@pytest.mark.parametrize("n_rows", [3, 40])
def test_rows_grouped_by_expert_equal_the_row_by_row_sum(folder, n_rows):
    layer = load_model(folder).transformer.layers[1].feed_forward
    x = torch.randn(n_rows, 64, generator=torch.Generator().manual_seed(n_rows))
    experts = [dense_expert(e.w13.weight, e.w2.weight) for e in layer.experts]
    want = naive_moe(layer, x, experts, shared_of(layer))
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_rows", [3, 40])  # int4_mm below small_rows, int4_gemm past it
def test_int4_experts_equal_their_dequantized_weights(folder, n_rows):
    """quantize(.., "int4") swaps each expert's linears for QuantLinears (the router stays
    float); the layer then computes the row-by-row sum over the int4 grid's weights up to the
    kernels' int8 activation rounding (~0.5% of a linear's largest output, each; measured
    2.3% of the layer's through gate, up and down: the tolerance is 5%)."""
    loaded = load_model(folder)
    float_layer = loaded.transformer.layers[0].feed_forward

    def on_grid(w: torch.Tensor) -> torch.Tensor:  # bfloat16 scales, as QuantLinear keeps
        q, scales_zeros = quantize_int4(w.float())
        return dequantize_int4(q, scales_zeros.bfloat16().float())

    grid = [dense_expert(on_grid(e.w13.weight), on_grid(e.w2.weight)) for e in float_layer.experts]
    shared = shared_of(float_layer, on_grid)
    quantize(loaded.transformer, "int4")
    layer = loaded.transformer.layers[0].feed_forward
    assert isinstance(layer.experts[0].w13, QuantLinear)
    assert type(layer.router) is torch.nn.Parameter  # the router stays float
    x = torch.randn(n_rows, 64, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        got, want = layer(x), naive_moe(layer, x, grid, shared)
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())


@pytest.mark.parametrize("sigmoid", [False, True])
def test_routing_gives_the_same_bits_wherever_the_heap_puts_its_buffers(sigmoid):
    """moe_route on the same logits, each call on a fresh copy after a few more C allocations
    held (so its scratch lands elsewhere relative to the logits): always the same weights. Its
    vectorized exp loops once took a scalar path where the scratch lay just past the logits
    (step.cpp's NOTE): the one-call step and the Python layers then differed by an ulp now and
    then, and this test failed in 7 (softmax) and 3 (sigmoid) of its 300 sequences."""
    kernels = require_kernels()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    rng, held = random.Random(3), []
    try:
        for n in [*range(1, 13)] * 25:
            logits = torch.randn(n, 8, generator=torch.Generator().manual_seed(n + len(held)))
            first = kernels.moe_route(logits, 2, True, sigmoid, None, 1.0)
            for _ in range(20):
                held.append(libc.malloc(rng.choice([16, 24, 32, 48, 64, 100, 128, 200])))
                again = kernels.moe_route(logits.clone(), 2, True, sigmoid, None, 1.0)
                assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1]), n
    finally:
        for p in held:
            libc.free(p)


NATIVE_CASES = [
    (m, d, q, n)
    for m in MOE_TYPES
    for d in ("bfloat16", "float32")
    for q, n in (("int4", 1), ("int4", 10), ("int8", 3), ("gguf", 3))
]


@pytest.mark.parametrize("model_type, dtype, quant, n_seq", NATIVE_CASES)
def test_the_one_call_step_runs_moe_layers_as_the_python_ones(
    tmp_path, model_type, dtype, quant, n_seq, monkeypatch
):
    """step.cpp moe_ffn: the same routing, grouping and kernels as MoEFeedForward, so the
    logits are bit for bit the Python layers' (10 sequences: past small_rows, int4_gemm and
    the dense copies; "gguf": a Q8_0 file's own blocks); OLMoE's q/k norms over the whole
    projection too."""
    require_kernels()
    folder = write_tiny_moe(tmp_path / model_type, model_type, seed=1)
    if quant == "gguf":
        path = write_tiny_moe_gguf(tmp_path / "moe.gguf", folder, qtype="Q8_0")
        loaded = load_model(path, dtype=dtype, blocks=True)
    else:
        loaded = load_model(folder, dtype=dtype)
        quantize(loaded.transformer, quant)
    worker = make_worker(loaded, n_cells=512)
    assert worker.paths.native is not None, worker.paths.describe()
    prompts = [make_prompt(9 + 5 * s, seed=s) for s in range(n_seq)]
    calls = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    load = loaded.transformer.layers[0].feed_forward.expert_rows
    native = decode(worker, prompts, steps=6)
    assert len(calls) == 6 + prompt_kernel_runs(worker)
    assert int(load.sum()) == 2 * (sum(map(len, prompts)) + 6 * n_seq)  # counted in C++ too
    worker.paths.native = None
    assert torch.equal(native, decode(worker, prompts, steps=6))


def serve(loaded: LoadedModel, reqs: list[Request]) -> Outcome:
    config = make_config(
        n_cells=512, n_seq_max=8, n_batch=64, n_ctx_seq=256, memory_spec=loaded.config.memory_spec
    )
    worker = make_worker(loaded, config.n_cells)
    sched, outcome = Scheduler(config, config.make_memory()), Outcome()
    for r in reqs:
        sched.add_request(r)
    while sched.has_work:
        step(sched, worker, outcome)  # type: ignore[arg-type]
    return outcome


def test_concurrent_sequences_each_equal_alone(folder):
    """Batched steps route each row on its own: a row's experts and output do not depend on
    the other rows of its step (prompt chunks and decodes mixed by the real scheduler)."""
    loaded = load_model(folder)
    greedy = SamplingParams(temperature=0.0)
    reqs = [
        Request(f"r{i}", make_prompt(n, seed=i), max_tokens=10, ignore_eos=True, sampling=greedy)
        for i, n in enumerate([3, 30, 90, 12, 55])
    ]
    together = serve(loaded, reqs)
    for r in reqs:
        alone = serve(
            loaded,
            [Request(r.req_id, r.prompt_ids, max_tokens=10, ignore_eos=True, sampling=greedy)],
        )
        assert together.tokens[(r.req_id, 0)] == alone.tokens[(r.req_id, 0)], r.req_id


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_the_server_answers_with_a_moe_model(tmp_path, fmt):
    """The HF folder in the reference mode; its Q4_0 GGUF with the server's defaults for this
    CPU (model.load.loader.choose_runtime)."""
    folder = write_tiny_moe(tmp_path / "served", seed=3)
    if fmt == "hf":
        server = start_server(model=str(folder), n_cells=256, dtype="float32", quant="none")
    else:
        path = write_tiny_moe_gguf(tmp_path / "served.gguf", folder, qtype="Q4_0")
        server = start_server(model=str(path), n_cells=256)
    try:
        body = {"prompt": "Hello world", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"]
        # the expert load: every token computed (the prompt, 7 fed-back choices) took 2 experts
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        rows = [ln for ln in metrics.splitlines() if ln.startswith("cellserve_moe_expert_rows_")]
        assert len(rows) == 2 * 8  # 2 layers x 8 experts
        layer0 = sum(float(ln.split()[-1]) for ln in rows if 'layer="0"' in ln)
        assert layer0 == 2 * (out["usage"]["prompt_tokens"] + 7)
        # the page's copy of the same counts (/v1/cache/cells `experts`)
        experts = httpx.get(f"{server.url}/v1/cache/cells", timeout=10).json()["experts"]
        assert len(experts["rows"]) == 2 and len(experts["rows"][0]) == 8
        assert sum(experts["rows"][0]) == layer0
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    finally:
        server.stop()
