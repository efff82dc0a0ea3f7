"""Mamba (1) and Falcon-Mamba over state slots against transformers (random models: every weight
redrawn) and llama.cpp (its converter's GGUF, llama-server's logprobs), and the slot contract
of scheduler.plan.GroupBatch: chunked prefill, captures, copies, mixed steps."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model import load_model
from model.kernels import load_kernels
from model.layers.ggml import BlockLinear, has_block_kernels
from model.layers.mamba import selective_scan
from model.layers.quant import quantize
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
from tests.tiny_ssm import write_tiny_jamba, write_tiny_mamba

transformers = pytest.importorskip("transformers")
# llama-server's logprobs on the converter's float32 GGUF: measured worst 7.6e-6 (Mamba) and
# 2.6e-5 (Falcon-Mamba)
LLAMA_CPP_F32 = 0.001
JAMBA_BPE = "conversion.jamba:JambaModel"  # its converter writes the tiny BPE as GPT-2's


@pytest.fixture(scope="module", params=["mamba", "falcon"])
def variant(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "tiny"
    write_tiny_mamba(folder, falcon=request.param == "falcon", long_memory=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, load_model(folder), hf


def driver(tiny, n_slots: int = 8, **kw) -> StateDriver:
    return StateDriver(make_worker(tiny, n_cells=16, group_cells=[n_slots], **kw), 16, n_slots)


def state_of(d: StateDriver, seq: int) -> list[torch.Tensor]:
    st, slot = d.worker.state, d.slot[seq]
    return [t for layer in st.layers for t in (st.conv(layer)[slot], st.ssm(layer)[slot])]


def test_description_read_from_the_config(variant):
    name, _, tiny, _ = variant
    args = tiny.config
    assert args.mixers == ("mamba",) * 3 and not args.ffn
    desc = args.layer_desc(0)
    assert desc.mixer == "mamba" and desc.rope is None and "ffn_norm" not in desc.weights
    m = args.mamba
    assert (m.d_inner, m.d_state, m.d_conv, m.dt_rank) == (128, 16, 4, 6)
    assert m.dt_b_c_norm == ("plain" if name == "falcon" else "none")
    assert [g.key for g in args.memory_spec.groups] == ["recurrent"]
    worker = make_worker(tiny, n_cells=16, group_cells=[4])
    # per layer: conv 128 x 3 float32 + ssm 128 x 16 float32
    assert worker.state_bytes_per_slot == 3 * (128 * 3 + 128 * 16) * 4


@pytest.mark.parametrize("rows", [1, 5, 256])
def test_selective_scan_is_the_token_recurrence(rows):
    g = torch.Generator().manual_seed(rows)
    L, D, N = 37, 12, 6
    x, dt = torch.randn(L, D, generator=g), torch.rand(L, D, generator=g)
    b, c = torch.randn(L, N, generator=g), torch.randn(L, N, generator=g)
    a = -torch.rand(D, N, generator=g) * 2
    state = torch.randn(D, N, generator=g)
    before = state.clone()
    y, final = selective_scan(x, dt, a, b, c, state, rows)
    s, ys = before, []
    for t in range(L):
        s = torch.exp(dt[t][:, None] * a) * s + (dt[t] * x[t])[:, None] * b[t][None, :]
        ys.append(s @ c[t])
    torch.testing.assert_close(y, torch.stack(ys), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, s, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, before), "the starting state is read, not written"


@pytest.mark.parametrize("n", [3, 40, 700])
def test_prompt_logits_match_transformers(variant, n):
    _, _, tiny, hf = variant
    ids = prompt(n, seed=n)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close(driver(tiny).logits([Chunk(0, ids, all_rows=True)]), ref)


@pytest.mark.parametrize("n", [5, 300])
def test_greedy_decode_matches_transformers(variant, n):
    _, _, tiny, hf = variant
    ids = prompt(n, seed=n + 1)
    ref_tokens, ref = hf_greedy(hf, ids, 16)
    tokens, ours = greedy(driver(tiny), 0, ids, 16)
    assert_close(ours, ref)
    assert tokens == ref_tokens


@pytest.mark.parametrize("size", [1, 7, 300])
def test_prefill_in_chunks_gives_the_same_state(variant, size):
    tiny = variant[2]
    n = 60 if size == 1 else 700
    ids = prompt(n, seed=2)
    whole = driver(tiny)
    ref = whole.logits([Chunk(0, ids)])
    parts = driver(tiny)
    for lo in range(0, n, size):
        ours = parts.logits([Chunk(0, ids[lo : lo + size])])
    assert_close(ours, ref)
    for a, b in zip(state_of(parts, 0), state_of(whole, 0), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_captures_hold_the_state_of_the_prefix(variant):
    """Capture(seq, m, slot): the slot gets the state after positions < m; resuming from it
    gives what a prefill of the first m tokens gives."""
    tiny = variant[2]
    ids = prompt(100, seed=3)
    d = driver(tiny)
    d.free_slots = [0, 1, 2, 3]
    d.logits([Chunk(0, ids[:20])])
    d.logits([Chunk(0, ids[20:], captures=[(37, 0), (64, 1), (100, 2)])])
    for m, slot in [(37, 0), (64, 1), (100, 2)]:
        ref = driver(tiny)
        ref.logits([Chunk(0, ids[:m])])
        captured = StateDriver(d.worker, 16, 8)
        captured.resume(5, slot, m, [])
        for a, b in zip(state_of(captured, 5), state_of(ref, 0), strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        nxt = [ids[m] if m < 100 else 11, 23]
        assert_close(captured.logits([Chunk(5, nxt)]), ref.logits([Chunk(0, nxt)]))


def test_mixed_step_and_fork_equal_each_sequence_alone(variant):
    """Decode rows over scattered slots beside a prompt chunk, then a forked state."""
    tiny = variant[2]
    lengths = [3, 30, 9, 50]
    d = driver(tiny)
    d.logits([Chunk(s, prompt(n, s)) for s, n in enumerate(lengths[:3])])
    chunks = [Chunk(s, [40 + s]) for s in range(3)] + [Chunk(3, prompt(50, 3))]
    together = d.logits(chunks)
    for s, n in enumerate(lengths):
        alone = driver(tiny)
        if s < 3:
            alone.logits([Chunk(0, prompt(n, s))])
            ref = alone.logits([Chunk(0, [40 + s])])
        else:
            ref = alone.logits([Chunk(0, prompt(n, s))])
        assert_close(together[s : s + 1], ref)
    d.fork(3, 4)
    both = d.logits([Chunk(3, [5]), Chunk(4, [6])])
    for row, tok in ((0, 5), (1, 6)):
        alone = driver(tiny)
        alone.logits([Chunk(0, prompt(50, 3))])
        assert_close(both[row : row + 1], alone.logits([Chunk(0, [tok])]))


@pytest.mark.parametrize(("mode", "rel"), [("int8", 0.03), ("int4", 0.2)])
def test_quantized_weights_keep_working(variant, mode, rel):
    """quantize() swaps ssm_in / ssm_out like any Linear; ssm_x and ssm_dt stay float32. A
    prompt (dense path) and one token a step (quantized kernels) both stay near float32, as a
    share of the logits' spread (a KL says little here: these random models' next-token
    distributions are nearly one-hot, spreads of ~100). Measured: int8 0.003 (Mamba) and 0.013
    (Falcon-Mamba, whose dt / B / C norms enlarge the error), int4 0.017 and 0.10."""
    _, folder, tiny, _ = variant
    q = load_model(folder)
    quantize(q.transformer, mode)
    assert type(q.transformer.layers[0].mixer.in_proj).__name__ == "QuantLinear"
    ids = prompt(40, seed=6)
    ref = driver(tiny).logits([Chunk(0, ids, all_rows=True)])
    stepped = driver(q)
    for ours in (
        driver(q).logits([Chunk(0, ids, all_rows=True)]),
        torch.cat([stepped.logits([Chunk(0, [t])]) for t in ids]),
    ):
        diff = float((ours - ref).abs().max()) / float(ref.max() - ref.min())
        assert 0 < diff < rel, diff


def test_bfloat16_stays_close(variant):
    _, folder, tiny, _ = variant
    b = load_model(folder, dtype="bfloat16")
    ids = prompt(200, seed=7)
    ref = driver(tiny).logits([Chunk(0, ids)])
    ours = driver(b).logits([Chunk(0, ids)])
    assert b.transformer.dtype == torch.bfloat16
    assert float((ours - ref).abs().max()) < 0.05 * float(ref.max() - ref.min())


def test_llamacpp_gguf_and_llama_server(variant, tmp_path):
    """llama.cpp's converter (MambaModel: A = -exp(A_log), the conv squeezed, ssm.dt_b_c_rms
    for Falcon-Mamba) writes a GGUF that loads as the folder's model; llama-server's next-token
    logprobs on it are ours. Falcon-Mamba's GGUF norms dt / B / C with the model's rms epsilon
    (1e-5: llama.cpp has no key for the config's mixer_rms_eps, 1e-6), so its logits are
    llama.cpp's, a little off transformers'. A Q8_0 file runs on its own blocks."""
    name, _, tiny, hf = variant
    folder = variant[1]
    path = convert_with_llamacpp(folder, tmp_path / "f32.gguf")
    loaded = load_model(path)
    # the GGUF's dt / B / C norms take the rms epsilon (Falcon-Mamba's is not the config's)
    assert loaded.config.mamba == replace(tiny.config.mamba, norm_eps=loaded.config.norm_eps)
    ids = prompt(120, seed=1)
    ours = driver(loaded).logits([Chunk(0, ids, all_rows=True)])
    if name == "mamba":
        with torch.inference_mode():
            assert_close(ours, hf(torch.tensor([ids])).logits[0])
    if has_block_kernels(load_kernels()):
        q8 = convert_with_llamacpp(folder, tmp_path / "q8.gguf", "q8_0")
        blocks = load_model(q8, blocks=True)
        assert isinstance(blocks.transformer.layers[0].mixer.in_proj, BlockLinear)
        got = driver(blocks).logits([Chunk(0, ids)]).log_softmax(-1)[0]
        ref = ours[-1].log_softmax(-1)
        kl = float((ref.exp() * (ref - got)).sum())
        assert kl < 0.05, kl
    binary = llama_server_or_skip()
    prompts = [prompt(5 + 7 * seed, seed=30 + seed) for seed in range(6)]
    assert_same_next_token_logprobs(
        binary, path, tmp_path / "llama.log", prompts,
        lambda _, ids: driver(loaded).logits([Chunk(0, ids)])[0],
        LLAMA_CPP_F32, least=4,
    )  # fmt: skip


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_our_converter_writes_llama_cpps_file(variant, outtype, tmp_path):
    """model.load.hf_to_gguf on a Mamba / Falcon-Mamba folder: every mamba.* key, tensor name,
    ggml shape and storage type as llama.cpp's convert_hf_to_gguf (MambaModel) writes them,
    the same values (ssm_a = -exp(A_log) within an ulp: numpy's exp against torch's), and the
    file computes the folder's logits."""
    import numpy as np

    from model.load.gguf import open_gguf
    from model.load.hf_to_gguf import convert

    name, folder, tiny, hf = variant
    ours = open_gguf(convert(folder, tmp_path / "ours.gguf", outtype))
    theirs = open_gguf(convert_with_llamacpp(folder, tmp_path / "theirs.gguf", outtype))
    keys = {k: v for k, v in dict(theirs.fields).items() if k.startswith("mamba.")}
    assert keys["mamba.ssm.dt_b_c_rms"] is (name == "falcon")
    assert {k: v for k, v in dict(ours.fields).items() if k.startswith("mamba.")} == keys
    assert ours.fields["general.architecture"] == "mamba"
    mine = {t.name: t for t in ours.tensors}
    want = {t.name: t for t in theirs.tensors}
    assert sorted(mine) == sorted(want)
    for n, t in want.items():
        got = mine[n]
        assert (got.shape, got.tensor_type) == (t.shape, t.tensor_type), n
        a, b = np.asarray(got.data, np.float32), np.asarray(t.data, np.float32)
        if n.endswith("ssm_a"):
            np.testing.assert_allclose(a, b, rtol=2e-7)
        else:
            assert np.array_equal(a, b), n
    if outtype == "f32":
        loaded = load_model(tmp_path / "ours.gguf")
        assert loaded.config.mamba == replace(tiny.config.mamba, norm_eps=loaded.config.norm_eps)
        ids = prompt(60, seed=2)
        ours_logits = driver(loaded).logits([Chunk(0, ids, all_rows=True)])
        if name == "mamba":  # Falcon-Mamba's file norms with the rms epsilon (see above)
            with torch.inference_mode():
                assert_close(ours_logits, hf(torch.tensor([ids])).logits[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("norm", ["none", "plain", "weighted"])
def test_mamba_mix_kernel_is_the_torch_mixer(variant, norm, dtype, tmp_path):
    """kernels.mamba_mix (model/kernels/mamba.cpp) against MambaMixer's torch ops on the same
    states: decode rows over a range of slots and over scattered ones (both updated in place
    by the fused decode), and prompt chunks with captures: the outputs and every state, up to
    float32 rounding (the same math fused: another exp and op order), and in bfloat16 up to
    the torch path's bfloat16 conv sums (the kernel sums in float32). "weighted": Jamba's
    mixer (its dt / B / C norms' weights)."""
    from types import SimpleNamespace

    from kvcache.state_storage import RecurrentStorage
    from model.layers.batch import ForwardBatch, StateBatch, StatePrompt

    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "mamba_mix"):
        pytest.skip("no C++ kernels built for this CPU")
    name, folder = variant[0], variant[1]
    if (norm == "plain") != (name == "falcon"):
        pytest.skip("plain norms: Falcon-Mamba's")
    if norm == "weighted":
        folder = write_tiny_jamba(tmp_path / "jamba", attn_period=2, attn_offset=1, seed=4)
    model = load_model(folder, dtype=dtype)
    mixer = model.transformer.layers[0].mixer
    assert (mixer.norms is not None) == (norm != "none")
    assert mixer.kernel_takes(kernels, model.transformer.dtype)
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(80, model.config.dim, generator=gen).to(model.transformer.dtype)
    tol = 1e-5 if dtype == "float32" else 3e-2
    conv_shape, ssm_shape = model.config.state_shapes
    # decode rows 0, 5, 11; a 4-row chunk from slot 1 captured into 7 after 2 rows; a 68-row
    # chunk captured mid-way and at its end (every slot of the 8 used once)
    cases = (([2, 3, 4], (2, 5), 6, [(30, 5), (68, 0)]), ([6, 0, 3], None, 2, [(30, 5), (68, 4)]))
    for decode, run, slot, captures in cases:
        chunks = [StatePrompt(1, 5, 1, [(2, 7)]), StatePrompt(12, 80, slot, captures)]
        sb = StateBatch(torch.tensor([0, 5, 11]), torch.tensor(decode), chunks)
        sb.decode_run = run
        results = []
        for fused in (None, kernels):
            sb.native = None
            st = RecurrentStorage((0,), 8, conv_shape, ssm_shape, model.transformer.dtype)
            g = torch.Generator().manual_seed(1)
            st.conv(0).copy_(torch.randn(st.conv(0).shape, generator=g))
            st.ssm(0).copy_(torch.randn(st.ssm(0).shape, generator=g) * 0.1)
            batch = ForwardBatch.__new__(ForwardBatch)
            batch.fused, batch.state = fused, sb
            out = mixer(u, batch, SimpleNamespace(state=st), 0)
            results.append((out, st.conv(0).clone(), st.ssm(0).clone()))
        for want, got in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("arch", ["mamba", "falcon", "jamba"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quant", ["int4", "int8", "gguf"])
def test_the_one_call_step_runs_mamba_as_the_python_layers(
    tmp_path_factory, arch, dtype, quant, monkeypatch
):
    """Mamba, Falcon-Mamba and Jamba (Mamba mixers beside NoPE attention and experts) in
    step.cpp: mamba_mix between the linears, the op the Python layers call too. Sequences
    batched together (prompt chunks beside decode rows, a fork, a capture mid-chunk resumed by
    a new sequence): every step in one call, bit for bit the Python layers' logits."""
    from model.runner.native import NativeDecoder

    if load_kernels() is None:
        pytest.skip("no C++ kernels built for this CPU")
    where = tmp_path_factory.mktemp(arch) / "hf"
    if arch == "jamba":
        path = write_tiny_jamba(where, dim=128, hidden_dim=256, seed=3)
    else:
        path = write_tiny_mamba(where, dim=128, falcon=arch == "falcon", seed=3)
    if quant == "gguf":  # an F16 file's own blocks (BlockLinear), the mixers' projections too
        if not has_block_kernels(load_kernels()):
            pytest.skip("a build without ggml_linear")
        bpe_for = JAMBA_BPE if arch == "jamba" else ""
        f16 = convert_with_llamacpp(path, where.parent / "f16.gguf", "f16", bpe_for=bpe_for)
        loaded = load_model(f16, dtype=dtype, blocks=True)
        assert isinstance(loaded.transformer.layers[0].mixer.in_proj, BlockLinear)
    else:
        loaded = load_model(path, dtype=dtype)
        quantize(loaded.transformer, quant)
    cells = [512, 8] if arch == "jamba" else [8]
    worker = make_worker(loaded, n_cells=512, group_cells=cells)
    assert worker.paths.native is not None, worker.paths.describe()
    calls: list[int] = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = mixed_steps(worker, (3, 30, 9, 70, 20))
    prompt_steps = 3 if arch != "jamba" or worker.paths.prompt_attention is not None else 0
    assert len(calls) == 4 + prompt_steps
    worker.paths.native = None
    assert torch.equal(native, mixed_steps(worker, (3, 30, 9, 70, 20)))
