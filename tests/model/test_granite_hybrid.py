"""Granite 4.0-H (GraniteMoeHybrid) over attention cells + state slots against transformers:
NoPE and a rope (Bamba-like) variant, multipliers != 1, layer patterns starting with mamba and
with attention, and H-Tiny's mixture of experts beside the shared MLP (from the HF folder, our
GGUF and llama.cpp's, against llama-server too); a random model with every weight redrawn."""

from __future__ import annotations

import json

import pytest
import torch

import model.runner.worker
from model import load_model
from model.arch.args import MoEArgs
from model.errors import ModelLoadError
from model.kernels import load_kernels
from model.layers.ggml import BlockLinear, has_block_kernels
from model.load.hf_to_gguf import convert
from model.runner.worker import make_worker
from tests.llamacpp_convert import convert_with_llamacpp
from tests.llamacpp_server import assert_same_next_token_logprobs, llama_server_or_skip
from tests.model.state_driver import Chunk, StateDriver, assert_close, greedy, hf_greedy, prompt
from tests.tiny_ssm import write_tiny_bamba, write_tiny_granite_hybrid

VARIANTS = {
    "nope": dict(layer_types=("mamba", "attention", "mamba", "mamba", "attention")),
    "rope": dict(layer_types=("attention", "mamba", "mamba", "attention", "mamba"), rope=True),
    "moe": dict(layer_types=("mamba", "attention", "mamba", "mamba", "attention"), experts=4),
}
LLAMA_CPP_F32 = 0.01


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("granite") / request.param
    write_tiny_granite_hybrid(folder, seed=len(request.param), **VARIANTS[request.param])
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, load_model(folder), hf


def driver(tiny, n_cells: int = 4200, n_slots: int = 8) -> StateDriver:
    worker = make_worker(tiny, n_cells=n_cells, group_cells=[n_cells, n_slots])
    return StateDriver(worker, n_cells, n_slots)


def test_description_read_from_the_config(variant):
    name, _, tiny, _ = variant
    args = tiny.config
    assert args.nope == (name != "rope") and args.ffn
    attn = args.layer_desc(args.mixers.index("attn"))
    assert (attn.rope is None) == (name != "rope") and attn.residual_mult == 0.5
    assert (args.embed_mult, args.residual_mult, args.logits_scaling) == (2.0, 0.5, 4.0)
    assert args.attn_scale == pytest.approx(0.3)
    mixers = VARIANTS[name]["layer_types"]
    assert args.mixers == tuple("attn" if t == "attention" else "mamba2" for t in mixers)
    assert [g.key for g in args.memory_spec.groups] == ["full", "recurrent"]
    worker = make_worker(tiny, n_cells=32, group_cells=[32, 4])
    assert worker.kv_bytes_per_cell == 2 * 2 * 2 * 16 * 4  # 2 attention layers, K and V
    assert worker.state_bytes_per_slot == 3 * (192 * 3 + 8 * 16 * 16) * 4
    if name == "moe":  # every layer: 4 experts 32 wide (top 2, renormalized) + the shared MLP
        assert args.moe == MoEArgs(4, 2, 32, norm_topk_prob=True, shared_dim=96)
        assert all(args.is_moe(i) for i in range(args.n_layers))
    else:
        assert args.moe is None


@pytest.mark.parametrize("n", [4, 60, 2500])
def test_prompt_logits_match_transformers(variant, n):
    _, _, tiny, hf = variant
    ids = prompt(n, seed=n)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close(driver(tiny).logits([Chunk(0, ids, all_rows=True)]), ref)


@pytest.mark.parametrize("n", [6, 700])
def test_greedy_decode_matches_transformers(variant, n):
    _, _, tiny, hf = variant
    ids = prompt(n, seed=n + 1)
    ref_tokens, ref = hf_greedy(hf, ids, 20)
    tokens, ours = greedy(driver(tiny), 0, ids, 20)
    assert_close(ours, ref)
    assert tokens == ref_tokens


@pytest.mark.parametrize("size", [1, 7, 512])
def test_prefill_in_chunks_equals_one_prefill(variant, size):
    _, _, tiny, _ = variant
    n = 60 if size == 1 else 1100
    ids = prompt(n, seed=2)
    whole = driver(tiny)
    ref = whole.logits([Chunk(0, ids)])
    parts = driver(tiny)
    for lo in range(0, n, size):
        ours = parts.logits([Chunk(0, ids[lo : lo + size])])
    assert_close(ours, ref)
    assert_close(parts.logits([Chunk(0, [7, 8])]), whole.logits([Chunk(0, [7, 8])]))


@pytest.mark.parametrize("kernels", [True, False])
def test_mixed_step_equals_each_sequence_alone(variant, kernels, monkeypatch):
    """Decode rows of three sequences beside a fourth's prompt chunk, and a fork (cells
    shared, state copied) in the same step; attention through the C++ kernels where built
    and through torch."""
    if not kernels:
        monkeypatch.setattr(model.runner.worker, "load_kernels", lambda: None)
    _, _, tiny, _ = variant
    lengths = [3, 30, 9, 50]
    d = driver(tiny)
    d.logits([Chunk(s, prompt(n, s)) for s, n in enumerate(lengths[:3])])
    d.fork(1, 4)
    chunks = [Chunk(s, [40 + s]) for s in range(3)] + [Chunk(3, prompt(50, 3)), Chunk(4, [99])]
    together = d.logits(chunks)
    for s, n in enumerate(lengths + [30]):
        alone = driver(tiny, n_cells=64)
        if s == 4:
            alone.logits([Chunk(0, prompt(30, 1))])
            ref = alone.logits([Chunk(0, [99])])
        elif s < 3:
            alone.logits([Chunk(0, prompt(n, s))])
            ref = alone.logits([Chunk(0, [40 + s])])
        else:
            ref = alone.logits([Chunk(0, prompt(n, s))])
        assert_close(together[s : s + 1], ref)


def test_capture_resumes_like_a_prefix_prefill(variant):
    _, _, tiny, _ = variant
    ids = prompt(80, seed=3)
    d = driver(tiny)
    d.free_slots = [0, 1]  # the sequence takes slot 1; the capture goes to slot 0
    d.logits([Chunk(0, ids, captures=[(33, 0)])])
    ref = driver(tiny)
    ref.logits([Chunk(0, ids[:33])])
    # a new sequence resumes from the capture over the first 33 cells of sequence 0
    d.resume(1, 0, 33, d.cells[0][:33])
    nxt = ids[33:40]
    assert_close(d.logits([Chunk(1, nxt, all_rows=True)]), ref.logits([Chunk(0, nxt, True)]))


def test_unknown_layer_types_and_a_bamba_with_experts_are_refused(variant, tmp_path):
    _, folder, _, _ = variant
    config = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(
        json.dumps(config | {"layer_types": ["mamba", "moe", "mamba", "mamba", "attention"]})
    )
    with pytest.raises(ModelLoadError, match="layer types"):
        load_model(bad)
    (bad / "config.json").write_text(
        json.dumps(config | {"model_type": "bamba", "num_local_experts": 4})
    )
    with pytest.raises(ModelLoadError, match="Bamba with experts"):
        load_model(bad)


def test_moe_ggufs_compute_the_folders_logits(variant, tmp_path):
    """H-Tiny's layout in a GGUF, as our converter (model/load/hf_to_gguf.py) and llama.cpp's
    (convert_hf_to_gguf.py GraniteHybridModel) write it: ffn_{gate,up,down}_exps split from
    input_linear, ffn_*_shexp from the shared MLP, feed_forward_length the experts' width;
    both give transformers' logits, and llama-server (where built) our next-token logprobs."""
    name, folder, tiny, hf = variant
    if name != "moe":
        pytest.skip("the dense variants' GGUFs: tests/model/test_gguf_ssm.py")
    ids = prompt(300, seed=4)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = convert(folder, tmp_path / "ours.gguf")
    # llama.cpp's converter finds the attention layers by the released names only
    released = tmp_path / "released"
    released.mkdir()
    for f in folder.iterdir():
        (released / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    kinds = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [kinds.get(t, t) for t in config["layer_types"]]
    (released / "config.json").write_text(json.dumps(config))
    theirs = convert_with_llamacpp(released, tmp_path / "llamacpp.gguf")
    for path in (ours, theirs):
        loaded = load_model(path)
        assert loaded.config.moe == tiny.config.moe and loaded.config.mixers == tiny.config.mixers
        assert_close(driver(loaded, n_cells=512).logits([Chunk(0, ids, all_rows=True)]), ref)
    if has_block_kernels(load_kernels()):  # on an F16 file's own blocks, the mixers' too
        f16 = convert(folder, tmp_path / "f16.gguf", "f16")
        blocks = load_model(f16, blocks=True)
        layer = blocks.transformer.layers[0]
        assert isinstance(layer.mixer.in_proj, BlockLinear)
        assert isinstance(layer.feed_forward.shared.w13, BlockLinear)
        dense = driver(load_model(f16), n_cells=512).logits([Chunk(0, ids, all_rows=True)])
        assert_close(driver(blocks, n_cells=512).logits([Chunk(0, ids, all_rows=True)]), dense)
    binary = llama_server_or_skip()
    loaded = load_model(theirs)
    prompts = [prompt(5 + 7 * seed, seed=30 + seed) for seed in range(6)]
    # measured: within LLAMA_CPP_F32 (llama.cpp's float16 K/V)
    assert_same_next_token_logprobs(
        binary, theirs, tmp_path / "llama.log", prompts,
        lambda _, ids: driver(loaded, n_cells=64).logits([Chunk(0, ids)])[0],
        LLAMA_CPP_F32, least=4,
    )  # fmt: skip


def test_bamba_matches_transformers(tmp_path):
    """Bamba: the same mixer, rope on half of each head, Llama names for the MLP.
    NOTE: transformers 5.24's Bamba disagrees with itself one token at a time through its
    cache (1.7 off its own full forward at the first step; Granite's same-shaped model agrees
    to 3e-6), so the decode steps are checked against its full forward over our tokens."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_bamba(tmp_path / "bamba", seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tiny = load_model(folder)
    assert tiny.config.rope.dim == 8 and not tiny.config.nope
    ids = prompt(300, seed=9)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close(driver(tiny, n_cells=512).logits([Chunk(0, ids, all_rows=True)]), ref)
    tokens, ours = greedy(driver(tiny, n_cells=64), 0, ids[:20], 12)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids[:20] + tokens[:-1]])).logits[0, 19:]
    assert_close(ours, ref)


def test_batch_invariant_and_bfloat16(variant):
    """--batch-invariant pads the step with rows that write a scratch cell and no state; a
    bfloat16 model (fused C++ norms where built, the SSM still float32) stays close."""
    _, folder, tiny, _ = variant
    ids = prompt(40, seed=8)
    plain = driver(tiny, n_cells=64)
    worker = make_worker(tiny, n_cells=64, group_cells=[64, 8], batch_invariant=True)
    padded = StateDriver(worker, 64, 8)
    for chunk in (ids, [17], [18]):
        assert_close(padded.logits([Chunk(0, chunk)]), plain.logits([Chunk(0, chunk)]))
    b = load_model(folder, dtype="bfloat16")
    ref = driver(tiny, n_cells=64).logits([Chunk(0, ids, all_rows=True)])
    ours = driver(b, n_cells=64).logits([Chunk(0, ids, all_rows=True)])
    assert float((ours - ref).abs().max()) < 0.05 * float(ref.max() - ref.min())


def test_released_configs_name_the_layers_mamba_and_attention(variant, tmp_path):
    """Granite 4.0-H's own config.json says layers_block_type: mamba / attention (transformers
    5 writes layer_types: linear_attention / full_attention): both read the same."""
    name, folder, tiny, _ = variant
    config = json.loads((folder / "config.json").read_text())
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in folder.iterdir():
        (legacy / f.name).write_bytes(f.read_bytes())
    config.pop("layer_types")
    config["layers_block_type"] = list(VARIANTS[name]["layer_types"])
    (legacy / "config.json").write_text(json.dumps(config))
    old = load_model(legacy)
    assert old.config.mixers == tiny.config.mixers
    ids = prompt(20, seed=10)
    assert torch.equal(
        driver(old, 64).logits([Chunk(0, ids)]), driver(tiny, 64).logits([Chunk(0, ids)])
    )
