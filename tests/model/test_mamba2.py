"""Mamba2 over state slots against transformers (a random model: every weight redrawn), and
the slot contract of scheduler.plan.GroupBatch: chunked prefill, captures, copies, zeroing,
mixed steps."""

from __future__ import annotations

import pytest
import torch

from model import load_model
from model.layers.mamba2 import ssd_scan
from model.layers.quant import quantize
from model.runner.worker import make_worker
from tests.model.state_driver import (
    Chunk,
    StateDriver,
    assert_close,
    greedy,
    hf_greedy,
    mixed_steps,
    prompt,
)
from tests.tiny_ssm import write_tiny_mamba2


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_mamba2(tmp_path_factory.mktemp("mamba2") / "tiny")


@pytest.fixture(scope="module")
def tiny(folder):
    return load_model(folder)


@pytest.fixture(scope="module")
def hf_tiny(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def driver(tiny, n_slots: int = 8, **kw) -> StateDriver:
    return StateDriver(make_worker(tiny, n_cells=16, group_cells=[n_slots], **kw), 16, n_slots)


def state_of(d: StateDriver, seq: int) -> list[torch.Tensor]:
    st, slot = d.worker.state, d.slot[seq]
    return [t for layer in st.layers for t in (st.conv(layer)[slot], st.ssm(layer)[slot])]


def test_description_read_from_the_config(tiny):
    args = tiny.config
    assert args.mixers == ("mamba2",) * 3 and not args.ffn
    desc = args.layer_desc(0)  # what Block builds, and why the C++ step passes it by
    assert desc.mixer == "mamba2" and desc.rope is None and "ffn_norm" not in desc.weights
    s = args.ssm
    assert (s.n_heads, s.head_dim, s.d_state, s.n_groups, s.d_conv) == (8, 16, 16, 2, 4)
    assert [g.key for g in args.memory_spec.groups] == ["recurrent"]
    worker = make_worker(tiny, n_cells=16, group_cells=[4])
    # per layer: conv 192 x 3 float32 + ssm 8 x 16 x 16 float32
    assert worker.state_bytes_per_slot == 3 * (192 * 3 + 8 * 16 * 16) * 4
    assert worker.kv_bytes_per_cell == 0


@pytest.mark.parametrize(("chunk", "groups"), [(1, 1), (3, 2), (8, 4), (64, 2)])
def test_chunked_scan_equals_the_token_recurrence(chunk, groups):
    g = torch.Generator().manual_seed(chunk)
    L, H, P, N = 37, 4, 8, 6
    x = torch.randn(L, H, P, generator=g)
    b, c = (torch.randn(L, groups, N, generator=g) for _ in range(2))
    dt = torch.rand(L, H, generator=g)
    a = -torch.rand(H, generator=g) * 2
    state = torch.randn(H, P, N, generator=g)
    y, final = ssd_scan(x, dt, a, b, c, state, chunk)
    s, ys = state, []
    for t in range(L):
        bh = b[t].repeat_interleave(H // groups, dim=0)  # head h reads group h // (H / G)
        ch = c[t].repeat_interleave(H // groups, dim=0)
        s = (
            s * torch.exp(dt[t] * a)[:, None, None]
            + (dt[t][:, None] * x[t])[..., None] * bh[:, None]
        )
        ys.append(torch.einsum("hpn,hn->hp", s, ch))
    torch.testing.assert_close(y, torch.stack(ys), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, s, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n", [3, 40, 700, 3000])
def test_prompt_logits_match_transformers(tiny, hf_tiny, n):
    ids = prompt(n, seed=n)
    with torch.inference_mode():
        ref = hf_tiny(torch.tensor([ids])).logits[0]
    ours = driver(tiny).logits([Chunk(0, ids, all_rows=True)])
    assert_close(ours, ref)


@pytest.mark.parametrize("n", [5, 1500])
def test_greedy_decode_matches_transformers(tiny, hf_tiny, n):
    ids = prompt(n, seed=n + 1)
    ref_tokens, ref = hf_greedy(hf_tiny, ids, 24)
    tokens, ours = greedy(driver(tiny), 0, ids, 24)
    assert_close(ours, ref)
    assert tokens == ref_tokens


@pytest.mark.parametrize("size", [1, 7, 512])
def test_prefill_in_chunks_gives_the_same_state(tiny, size):
    n = 90 if size == 1 else 1100
    ids = prompt(n, seed=2)
    whole = driver(tiny)
    ref = whole.logits([Chunk(0, ids)])
    parts = driver(tiny)
    for lo in range(0, n, size):
        ours = parts.logits([Chunk(0, ids[lo : lo + size])])
    assert_close(ours, ref)
    for a, b in zip(state_of(parts, 0), state_of(whole, 0), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    nxt = [17, 99]
    assert_close(parts.logits([Chunk(0, nxt)]), whole.logits([Chunk(0, nxt)]))


def test_captures_hold_the_state_of_the_prefix(tiny):
    """Capture(seq, m, slot): the slot gets the state after positions < m; resuming from it
    gives what a prefill of the first m tokens gives."""
    ids = prompt(100, seed=3)
    d = driver(tiny)
    d.free_slots = [0, 1, 2, 3]  # slot 3 for the sequence, 0 and 1 for the captures
    d.logits([Chunk(0, ids[:20])])
    d.logits([Chunk(0, ids[20:], captures=[(37, 0), (64, 1), (100, 2)])])
    for m, slot in [(37, 0), (64, 1), (100, 2)]:
        captured, ref = resume_capture(tiny, d, slot, ids[:m])
        nxt = [ids[m] if m < 100 else 11, 23]
        assert_close(captured.logits([Chunk(5, nxt)]), ref.logits([Chunk(0, nxt)]))


def resume_capture(tiny, d: StateDriver, slot: int, prefix: list[int]):
    """A sequence resumed from the state `slot` of d's worker holds, and a prefill of `prefix`
    on a fresh driver: their states agree (returns both drivers, the resumed one's seq 5)."""
    ref = driver(tiny)
    ref.logits([Chunk(0, prefix)])
    captured = StateDriver(d.worker, 16, d.worker.state.n_cells)
    captured.resume(5, slot, len(prefix), [])
    for a, b in zip(state_of(captured, 5), state_of(ref, 0), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    return captured, ref


def test_mixed_step_equals_each_sequence_alone(tiny):
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


def test_fork_copies_the_state_and_a_reused_slot_starts_from_zero(tiny):
    ids = prompt(25, seed=4)
    d = driver(tiny, n_slots=3)
    d.logits([Chunk(0, ids)])
    d.fork(0, 1)  # copy slot -> a new slot, pending before the next forward
    both = d.logits([Chunk(0, [5]), Chunk(1, [6])])
    for s, tok in [(0, 5), (1, 6)]:
        alone = driver(tiny)
        alone.logits([Chunk(0, ids)])
        assert_close(both[s : s + 1], alone.logits([Chunk(0, [tok])]))
    # seq 0 ends; its slot goes to a new sequence, which must start from the zero state
    d.free_slots.append(d.slot.pop(0))
    fresh = d.logits([Chunk(2, ids[:9])])
    assert_close(fresh, driver(tiny).logits([Chunk(0, ids[:9])]))


def test_batch_invariant_padding_rows_leave_the_states_alone(tiny):
    ids = prompt(12, seed=5)
    plain = driver(tiny)
    padded = driver(tiny, batch_invariant=True)
    for chunk in (ids, [17], [18]):
        assert_close(padded.logits([Chunk(0, chunk)]), plain.logits([Chunk(0, chunk)]))


@pytest.mark.parametrize(("mode", "max_kl"), [("int8", 0.01), ("int4", 0.1)])
def test_quantized_weights_keep_working(folder, tiny, mode, max_kl):
    """quantize() swaps ssm_in / ssm_out like any Linear (ssm_in's 328 rows padded for the
    int4 packing); a prompt (dense path) and one token a step (quantized kernels) both stay
    near float32: measured KL 0.0004 (int8) and 0.054 (int4, a random model's small margins)."""
    q = load_model(folder)
    quantize(q.transformer, mode)
    assert type(q.transformer.layers[0].mixer.in_proj).__name__ == "QuantLinear"
    ids = prompt(40, seed=6)
    ref = driver(tiny).logits([Chunk(0, ids, all_rows=True)]).log_softmax(-1)
    stepped = driver(q)
    for ours in (
        driver(q).logits([Chunk(0, ids, all_rows=True)]),
        torch.cat([stepped.logits([Chunk(0, [t])]) for t in ids]),
    ):
        kl = float((ref.exp() * (ref - ours.log_softmax(-1))).sum(-1).mean())
        assert kl < max_kl, kl


def test_bfloat16_stays_close(folder, tiny):
    b = load_model(folder, dtype="bfloat16")
    ids = prompt(200, seed=7)
    ref = driver(tiny).logits([Chunk(0, ids)])
    ours = driver(b).logits([Chunk(0, ids)])
    assert b.transformer.dtype == torch.bfloat16
    assert float((ours - ref).abs().max()) < 0.05 * float(ref.max() - ref.min())


def test_a_step_that_raises_leaves_every_state_as_it_was(tiny, monkeypatch):
    """The layers update states as they go; the engine re-runs the sequences of a failing
    batch (scheduler/isolate.py), so a step that raises past the first layer must put the
    states back, or the re-run would start from half-updated ones."""
    ids = prompt(30, seed=6)
    d = driver(tiny)
    d.step([Chunk(0, ids[:20]), Chunk(1, ids[:7])])
    before = [[t.clone() for t in state_of(d, s)] for s in (0, 1)]
    last = d.worker.model.layers[-1]
    calls = {"n": 0}

    def boom(*args, **kwargs):
        calls["n"] += 1
        raise RuntimeError("injected fault in the last layer")

    monkeypatch.setattr(last, "forward", boom)
    with pytest.raises(RuntimeError, match="injected fault"):
        d.step([Chunk(0, ids[20:]), Chunk(1, [9])])
    assert calls["n"] == 1
    for s in (0, 1):
        for a, b in zip(state_of(d, s), before[s], strict=True):
            assert torch.equal(a, b)
    monkeypatch.undo()
    d.pos[0], d.pos[1] = 20, 7  # the failed rows were never placed
    retried = d.logits([Chunk(0, ids[20:]), Chunk(1, [9])])
    ref = driver(tiny)
    ref.logits([Chunk(0, ids[:20]), Chunk(1, ids[:7])])
    assert_close(retried, ref.logits([Chunk(0, ids[20:]), Chunk(1, [9])]))


def test_a_step_that_raises_keeps_the_state_copies_it_carried(tiny, monkeypatch):
    """A plan's pending state copies are applied before the step's states are saved: a step
    that raises puts back the forked state, not what the slot held before the copy."""
    ids = prompt(20, seed=7)
    d = driver(tiny)
    d.step([Chunk(0, ids)])
    forked = [t.clone() for t in state_of(d, 0)]
    d.fork(0, 1)
    assert not any(bool(t.any()) for t in state_of(d, 1)), "the copy is still pending"

    def boom(*args, **kwargs):
        raise RuntimeError("injected fault in the last layer")

    monkeypatch.setattr(d.worker.model.layers[-1], "forward", boom)
    with pytest.raises(RuntimeError, match="injected fault"):
        d.step([Chunk(0, [5]), Chunk(1, [6])])
    for s in (0, 1):
        for a, b in zip(state_of(d, s), forked, strict=True):
            assert torch.equal(a, b)


def test_a_lone_sequences_step_copies_no_state(tiny, monkeypatch):
    """A plan of one sequence saves nothing before its forward (ModelWorker._save_states: its
    failure fails only its own request, whose slot goes uncached); a plan of two still does."""
    d = driver(tiny)
    d.step([Chunk(0, prompt(10, seed=1)), Chunk(1, prompt(8, seed=2))])
    saved: list[int] = []
    real = d.worker.state.save

    def save(slots):  # noqa: ANN001, ANN202
        saved.append(len(slots))
        return real(slots)

    monkeypatch.setattr(d.worker.state, "save", save)
    d.step([Chunk(0, [5])])
    assert saved == []
    d.step([Chunk(0, [6]), Chunk(1, [7])])
    assert saved == [2]


def test_a_verification_captures_the_state_before_each_drafted_row(tiny):
    """Speculative decoding's verifying chunk: a capture at every row (row by row, BY_ROWS);
    each capture holds the state of a prefill of the tokens before it; and a 30-row chunk
    scanned row by row gives the SSD scan's state. (The C++ mamba2_mix's rows-by-row path
    against these torch ops: test_mamba2_mix_kernel_is_the_torch_mixer.)"""
    ids = prompt(60, seed=4)
    d = driver(tiny, n_slots=16)
    d.free_slots = list(range(8, 16))  # slots 0..7 for the captures
    d.logits([Chunk(0, ids[:40])])
    caps = [(m, m - 41) for m in range(41, 49)]  # before each of rows 41..48: slots 0..7
    d.logits([Chunk(0, ids[40:49], captures=caps)])
    for m, slot in caps[::3]:
        resume_capture(tiny, d, slot, ids[:m])
    by_rows, scanned = driver(tiny, n_slots=16), driver(tiny)
    by_rows.logits([Chunk(0, ids[:30], captures=[(m, 15) for m in range(16, 31)])])
    scanned.logits([Chunk(0, ids[:30])])
    for a, b in zip(state_of(by_rows, 0), state_of(scanned, 0), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_mamba2_mix_kernel_is_the_torch_mixer(folder):
    """kernels.mamba2_mix (model/kernels/mamba2.cpp) against Mamba2Mixer's torch ops on the
    same states: decode rows over a range of slots (updated in place) and over scattered ones
    (gathered), a short prompt chunk with a capture (row by row: BY_ROWS), and a longer one
    (the SSD scan): the outputs and every state up to float32 rounding (ATen's ops, one for
    one, with another build's vectorization)."""
    from model.kernels import load_kernels
    from model.layers.batch import ForwardBatch, StateBatch, StatePrompt

    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "mamba2_mix"):
        pytest.skip("no C++ kernels built for this CPU")
    model = load_model(folder)
    mixer = model.transformer.layers[1].mixer
    gen = torch.Generator().manual_seed(0)
    n, dim = 40, model.config.dim
    u = torch.randn(n, dim, generator=gen)
    prompts = [StatePrompt(1, 5, 1, [(2, 7)]), StatePrompt(12, 40, 5, [(10, 6)])]
    for decode_slots, run in ((torch.tensor([2, 3, 4]), (2, 5)), (torch.tensor([6, 0, 3]), None)):
        sb = StateBatch(torch.tensor([0, 5, 11]), decode_slots, prompts)
        sb.decode_run = run
        states = []
        for fused in (None, kernels):
            sb.native = None
            storage = _states(model, torch.Generator().manual_seed(1))
            batch = ForwardBatch.__new__(ForwardBatch)
            batch.fused, batch.state = fused, sb
            out = mixer(u, batch, storage, 1)
            states.append((out, storage.state.conv(1).clone(), storage.state.ssm(1).clone()))
        for want, got in zip(states[0], states[1], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mamba2_mix_refuses_a_slot_twice_or_out_of_range(folder):
    """The fused decode rows update their slots' states in place from several threads: two rows
    on one slot, or a slot past the storage, is an error, not a race."""
    from model.kernels import load_kernels
    from model.layers.batch import ForwardBatch, StateBatch

    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "mamba2_mix"):
        pytest.skip("no C++ kernels built for this CPU")
    model = load_model(folder)
    mixer = model.transformer.layers[1].mixer
    u = torch.randn(3, model.config.dim, generator=torch.Generator().manual_seed(0))
    for slots in ([2, 5, 2], [2, 5, 8]):
        batch = ForwardBatch.__new__(ForwardBatch)
        batch.fused = kernels
        batch.state = StateBatch(torch.tensor([0, 1, 2]), torch.tensor(slots), [])
        with pytest.raises(RuntimeError, match=r"distinct and in range|is not in \[0, 8\)"):
            mixer(u, batch, _states(model, torch.Generator().manual_seed(1)), 1)


def _states(model, gen):
    """A GroupedKVStorage-like holder of random states for every layer (slots 0..7)."""
    from types import SimpleNamespace

    from kvcache.state_storage import RecurrentStorage

    conv_shape, ssm_shape = model.config.state_shapes
    layers = tuple(range(model.config.n_layers))
    st = RecurrentStorage(layers, 8, conv_shape, ssm_shape)
    for layer in layers:
        st.conv(layer).copy_(torch.randn(st.conv(layer).shape, generator=gen))
        st.ssm(layer).copy_(torch.randn(st.ssm(layer).shape, generator=gen) * 0.1)
    return SimpleNamespace(state=st)


@pytest.mark.parametrize("arch", ["mamba2", "granite", "granite_moe"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quant", ["int4", "int8", "gguf"])
def test_the_one_call_step_runs_mamba2_as_the_python_layers(
    tmp_path_factory, arch, dtype, quant, monkeypatch
):
    """Mamba2 and Granite 4.0-H (Mamba2 mixers beside attention, every layer an MLP; H-Tiny's
    experts and shared expert through moe_ffn) in step.cpp: mamba2_mix between the linears,
    the op the Python layers call too. Sequences
    batched together (prompt chunks beside decode rows, a fork, a capture mid-chunk resumed
    by a new sequence): every step in one call, bit for bit the Python layers' logits."""
    from model.kernels import load_kernels
    from model.layers.ggml import has_block_kernels
    from model.load.hf_to_gguf import convert
    from model.runner.native import NativeDecoder
    from tests.tiny_ssm import write_tiny_granite_hybrid

    if load_kernels() is None:
        pytest.skip("no C++ kernels built for this CPU")
    where = tmp_path_factory.mktemp(arch) / "hf"
    if arch == "mamba2":
        path = write_tiny_mamba2(where, dim=128, head_dim=32, seed=3)
    else:
        experts = 4 if arch == "granite_moe" else 0
        path = write_tiny_granite_hybrid(
            where, dim=128, hidden_dim=256, mamba_head_dim=32, experts=experts
        )
    if quant == "gguf":  # an F16 file's own blocks (BlockLinear), the mixers' projections too
        if not has_block_kernels(load_kernels()):
            pytest.skip("a build without ggml_linear")
        loaded = load_model(
            convert(path, where.parent / "f16.gguf", "f16"), dtype=dtype, blocks=True
        )
    else:
        loaded = load_model(path, dtype=dtype)
        quantize(loaded.transformer, quant)
    worker = make_worker(loaded, n_cells=512, group_cells=[512, 8] if arch != "mamba2" else [8])
    assert worker.paths.native is not None, worker.paths.describe()
    calls: list[int] = []
    layers = NativeDecoder.layers
    monkeypatch.setattr(NativeDecoder, "layers", lambda *a: calls.append(1) or layers(*a))
    native = mixed_steps(worker, (3, 30, 9, 70, 20))
    prompt_steps = 3 if arch == "mamba2" or worker.paths.prompt_attention is not None else 0
    assert len(calls) == 4 + prompt_steps
    worker.paths.native = None
    assert torch.equal(native, mixed_steps(worker, (3, 30, 9, 70, 20)))


def test_mamba2_mix_rows_do_not_depend_on_the_rows_beside_them(tmp_path):
    """kernels.mamba2_mix: a short chunk's rows (row by row, BY_ROWS) are bit for bit the same
    rows run as decode rows one step at a time, outputs and states: what --batch-invariant and
    a verification's drafted rows rely on. Before, the chunk's conv was at::conv1d's (another
    summation order than the decode rows' window sum) and dt's softplus ATen's over [L, H],
    whose vector body or scalar tail an element took by its place in the whole tensor (with
    24 heads the last 8 of a 1-row step went through the tail): the rows differed by ~1e-6."""
    from model.kernels import load_kernels
    from model.layers.batch import StateBatch, StatePrompt

    kernels = load_kernels()
    if kernels is None or not hasattr(kernels, "mamba2_mix"):
        pytest.skip("no C++ kernels built for this CPU")
    for heads, n in ((24, 5), (32, 12)):
        kw = dict(n_layers=2, dim=4 * heads, n_heads=heads, head_dim=8)
        folder = write_tiny_mamba2(tmp_path / f"m{heads}", **kw)
        model = load_model(folder)
        mixer = model.transformer.layers[1].mixer
        u = torch.randn(n, model.config.dim, generator=torch.Generator().manual_seed(0)) * 3
        zxbcdt, params = mixer.in_proj(u), mixer.native_params(kernels)

        def mix(rows, sb, storage, params=params):  # noqa: ANN001, ANN202
            conv, ssm = storage.state.conv(1), storage.state.ssm(1)
            return kernels.mamba2_mix(rows, conv, ssm, params, sb.native_state(kernels))

        chunked = _states(model, torch.Generator().manual_seed(1))
        empty = torch.zeros(0, dtype=torch.long)
        chunk = mix(zxbcdt, StateBatch(empty, empty, [StatePrompt(0, n, 2)]), chunked)
        stepped = _states(model, torch.Generator().manual_seed(1))
        one = [StateBatch(None, torch.tensor([2]), []) for _ in range(n)]
        steps = torch.cat([mix(zxbcdt[i : i + 1].clone(), one[i], stepped) for i in range(n)])
        assert torch.equal(chunk, steps), (heads, (chunk - steps).abs().amax(1))
        assert torch.equal(chunked.state.ssm(1)[2], stepped.state.ssm(1)[2])
        assert torch.equal(chunked.state.conv(1)[2], stepped.state.conv(1)[2])
