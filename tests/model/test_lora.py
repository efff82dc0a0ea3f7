"""LoRA adapters (model/load/lora.py, model/layers/lora.py) against transformers + PEFT on a
tiny random Llama, in the float32 reference mode, and the prefix cache's adapter keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from model.errors import ModelLoadError
from model.layers.lora import LoraLinear, LoraSet
from model.load.loader import LoadedModel, load_model
from model.load.lora import load_lora
from model.runner.worker import ModelWorker, make_worker
from scheduler.plan import LoraKey, SamplingParams, SeqBatch
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.model.factories import make_plan, prefill_chunk
from tests.scheduler.fakes import Outcome, make_config, make_prompt, step
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_lora import write_peft_adapter, write_tiny_gguf_lora
from tests.tiny_models import write_tiny_gemma3, write_tiny_llama

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_peft(base: Path, adapter: Path | None) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, Path, Path, LoadedModel, LoraSet]:
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_llama(root / "base")
    a = write_peft_adapter(base, root / "adapter-a", seed=1, targets=ALL_PROJ)
    b = write_peft_adapter(base, root / "adapter-b", seed=2, targets=["q_proj", "v_proj"], r=8)
    loaded = load_model(base)
    args, dtype = loaded.config, loaded.transformer.dtype
    loras = LoraSet(loaded.transformer, [load_lora(a, args, dtype), load_lora(b, args, dtype)])
    return base, a, b, loaded, loras


def worker_of(setup: tuple, n_cells: int = 512) -> ModelWorker:
    *_, loaded, loras = setup
    return make_worker(loaded, n_cells, lora=loras)


def serve(
    setup: tuple, batches: list[list[Request]], **cfg: object
) -> tuple[Outcome, Scheduler, ModelWorker]:
    config = make_config(**cfg)
    sched = Scheduler(config)
    worker = worker_of(setup, config.n_cells)
    outcome = Outcome()
    for batch in batches:
        for r in batch:
            sched.add_request(r)
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
    return outcome, sched, worker


def request(req_id: str, prompt: list[int], lora: LoraKey = (), n: int = 12) -> Request:
    greedy = SamplingParams(temperature=0.0)
    return Request(req_id, prompt, greedy, max_tokens=n, ignore_eos=True, lora=lora)


def test_loaded_adapter_reads_peft_config(setup: tuple) -> None:
    *_, loras = setup
    a, b = loras.adapters
    assert (a.rank, a.alpha, b.rank, b.alpha) == (4, 8.0, 8, 16.0)
    assert a.targets == ["w1", "w2", "w3", "wk", "wo", "wq", "wv"]
    assert b.targets == ["wq", "wv"]
    assert all(w.scaling == 2.0 for w in a.weights.values())


def test_prompt_logits_match_peft(setup: tuple) -> None:
    base, a_path, _, loaded, loras = setup
    prompt = make_prompt(9, seed=3)
    worker = worker_of(setup)
    plan = make_plan([prefill_chunk(0, prompt, 0, all_rows=True)])
    plan.seqs = [dataclasses.replace(s, lora=((0, 1.0),)) for s in plan.seqs]
    ours = worker.forward(plan)
    with torch.no_grad():
        theirs = hf_peft(base, a_path)(torch.tensor([prompt])).logits[0]
        plain = hf_peft(base, None)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    assert (theirs - plain).abs().max() > 0.1  # the adapter does change the logits


@pytest.mark.parametrize("adapter", [0, 1])
def test_greedy_equals_peft(setup: tuple, adapter: int) -> None:
    base, a_path, b_path, *_ = setup
    prompt = make_prompt(11, seed=4 + adapter)
    out, _, worker = serve(setup, [[request("r", prompt, ((adapter, 1.0),))]])
    want = hf_greedy(hf_peft(base, [a_path, b_path][adapter]), prompt, 12)
    assert out.tokens[("r", 0)] == want
    assert worker.num_lora_steps > 0


def test_base_request_unchanged_by_loaded_adapters(setup: tuple) -> None:
    base, *_ = setup
    prompt = make_prompt(10, seed=6)
    out, _, worker = serve(setup, [[request("r", prompt)]])
    assert out.tokens[("r", 0)] == hf_greedy(hf_peft(base, None), prompt, 12)
    assert worker.num_lora_steps == 0


@pytest.mark.parametrize("gather", [False, True])
def test_mixed_batch_equals_each_alone(
    setup: tuple, gather: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A base request, one under adapter 0 and one under adapter 1 in one batch (the prompts
    prefilled and decoded together) give what each gives served alone; also where the step
    gathers the adapters it uses instead of multiplying by all of them."""
    if gather:
        monkeypatch.setattr("model.layers.lora.ALL_ADAPTERS_MAX_COLS", 0)
    prompts = [make_prompt(13 + i, seed=20 + i) for i in range(3)]
    keys: list[LoraKey] = [(), ((0, 1.0),), ((1, 1.0),)]

    def reqs() -> list[Request]:
        return [request(f"r{i}", p, k) for i, (p, k) in enumerate(zip(prompts, keys, strict=True))]

    together, sched, _ = serve(setup, [reqs()], prefix_cache=False)
    assert sched.counters.num_steps == 12  # every step carried all three
    for i, r in enumerate(reqs()):
        alone, _, _ = serve(setup, [[r]], prefix_cache=False)
        assert together.tokens[(f"r{i}", 0)] == alone.tokens[(f"r{i}", 0)]
    assert len({tuple(together.tokens[(f"r{i}", 0)]) for i in range(3)}) == 3


def test_scaled_and_mixed_adapters(setup: tuple) -> None:
    """llama.cpp's per-request list: two adapters at once, each with its scale; scale 0 of an
    adapter is the base model."""
    base, a_path, *_ = setup
    prompt = make_prompt(12, seed=7)
    mix = ((0, 0.5), (1, 1.5))
    out, _, _ = serve(setup, [[request("m", prompt, mix), request("b", prompt)]])
    alone, _, _ = serve(setup, [[request("m", prompt, mix)]])
    assert out.tokens[("m", 0)] == alone.tokens[("m", 0)]
    assert out.tokens[("m", 0)] != out.tokens[("b", 0)]
    # the half-scaled adapter 0 alone equals PEFT with its scaling halved
    half, _, _ = serve(setup, [[request("h", prompt, ((0, 0.5),))]])
    hf = hf_peft(base, a_path)
    for module in hf.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.scaling = {k: v * 0.5 for k, v in module.scaling.items()}
    assert half.tokens[("h", 0)] == hf_greedy(hf, prompt, 12)


def test_prefix_cache_never_crosses_adapters(setup: tuple) -> None:
    system = make_prompt(40, seed=8)
    first = request("a", system + [5, 6], ((0, 1.0),))
    base_req = request("b", system + [7, 8])
    other = request("c", system + [9, 10], ((1, 1.0),))
    same = request("d", system + [11, 12], ((0, 1.0),))
    out, sched, _ = serve(setup, [[first], [base_req], [other], [same]], n_batch=64)
    assert out.finish[("b", 0)].num_cached_tokens == 0
    assert out.finish[("c", 0)].num_cached_tokens == 0
    assert out.finish[("d", 0)].num_cached_tokens == 40
    cold, _, _ = serve(setup, [[same]], prefix_cache=False)
    assert out.tokens[("d", 0)] == cold.tokens[("d", 0)]
    loras = {sched.prefix.lora(s) for s in sched.prefix.seq_ids}
    assert loras == {(), ((0, 1.0),), ((1, 1.0),)}


def test_running_prefix_sharing_keeps_adapters_apart(setup: tuple) -> None:
    """Two prompts with a long common prefix, admitted together under different adapters:
    neither waits for nor copies the other's cells."""
    system = make_prompt(48, seed=9)
    reqs = [request("a", system + [1], ((0, 1.0),)), request("b", system + [2])]
    out, sched, _ = serve(setup, [reqs], n_batch=256)
    assert sched.counters.prefix_running_hit_tokens == 0
    alone, _, _ = serve(setup, [[request("b", system + [2])]], prefix_cache=False)
    assert out.tokens[("b", 0)] == alone.tokens[("b", 0)]


def test_bad_adapters_are_refused(setup: tuple, tmp_path: Path) -> None:
    base, *_ = setup
    loaded = setup[3]
    other = write_tiny_llama(tmp_path / "wide", dim=96, hidden_dim=160)
    wide = write_peft_adapter(other, tmp_path / "wide-adapter", seed=3, targets=["q_proj"])
    with pytest.raises(ModelLoadError, match="do not fit the base weight"):
        load_lora(wide, loaded.config, torch.float32)
    with pytest.raises(ModelLoadError, match="no such file"):
        load_lora(tmp_path / "missing", loaded.config, torch.float32)
    dora = write_peft_adapter(base, tmp_path / "dora", seed=4, targets=["q_proj"], use_dora=True)
    with pytest.raises(ModelLoadError, match="DoRA"):
        load_lora(dora, loaded.config, torch.float32)
    assert np.isfinite(loaded.transformer.norm.weight.numpy()).all()


def test_gguf_lora_over_gguf_base_equals_peft(setup: tuple, tmp_path: Path) -> None:
    """llama.cpp's layout (Q/K rows of B permuted) over a float GGUF base: PEFT's tokens."""
    base, a_path, *_ = setup
    gguf_base = write_tiny_gguf(tmp_path / "base.gguf", base)
    adapter = write_tiny_gguf_lora(tmp_path / "a.gguf", a_path)
    loaded = load_model(gguf_base)
    lora = load_lora(adapter, loaded.config, torch.float32)
    assert lora.name == "a" and lora.alpha == 8.0 and lora.rank == 4
    peft_lora = load_lora(a_path, loaded.config, torch.float32)
    for name, w in peft_lora.weights.items():  # un-permuted back to PEFT's layout
        torch.testing.assert_close(lora.weights[name].b, w.b)
        torch.testing.assert_close(lora.weights[name].a, w.a)
        assert lora.weights[name].scaling == w.scaling
    prompt = make_prompt(10, seed=11)
    gguf_setup = (base, adapter, None, loaded, LoraSet(loaded.transformer, [lora]))
    out, _, _ = serve(gguf_setup, [[request("g", prompt, ((0, 1.0),))]])
    assert out.tokens[("g", 0)] == hf_greedy(hf_peft(base, a_path), prompt, 12)


def test_gguf_block_base_keeps_its_fast_path_for_base_rows(setup: tuple, tmp_path: Path) -> None:
    """A Q8_0 base on its own blocks (the C++ one-call step): a LoRA request batched with a
    base one gives each what it gives alone; base-only steps keep the C++ step."""
    base, a_path, *_ = setup
    gguf_base = write_tiny_gguf(tmp_path / "q8.gguf", base, qtype="Q8_0")
    adapter = write_tiny_gguf_lora(tmp_path / "a.gguf", a_path)
    loaded = load_model(gguf_base, blocks=True)
    loras = LoraSet(loaded.transformer, [load_lora(adapter, loaded.config, torch.float32)])
    q8_setup = (base, adapter, None, loaded, loras)
    prompts = [make_prompt(12, seed=12), make_prompt(14, seed=13)]

    def reqs() -> list[Request]:
        return [request("l", prompts[0], ((0, 1.0),)), request("b", prompts[1])]

    together, _, worker = serve(q8_setup, [reqs()], prefix_cache=False)
    if worker.paths.native is None:
        pytest.skip(f"no C++ step here: {worker.paths.why.get('one-call step')}")
    assert worker.num_lora_steps == 12
    for r in reqs():
        alone, _, w = serve(q8_setup, [[r]], prefix_cache=False)
        assert together.tokens[(r.req_id, 0)] == alone.tokens[(r.req_id, 0)]
        assert w.num_lora_steps == (12 if r.lora else 0)
    assert together.tokens[("l", 0)] != together.tokens[("b", 0)]


def test_int8_base_with_batch_invariant_worker(setup: tuple, tmp_path: Path) -> None:
    """LoRA over int8 QuantLinears: with a batch-invariant worker (one kernel at every row
    count) a LoRA request batched with a base one gives each its solo tokens, and the adapter
    moves the int8 model's tokens as it moves the float one's logits."""
    from model.layers.quant import quantize

    base, a_path, *_ = setup
    loaded = load_model(base)
    quantize(loaded.transformer, "int8")
    loras = LoraSet(loaded.transformer, [load_lora(a_path, loaded.config, torch.float32)])
    prompts = [make_prompt(12, seed=14), make_prompt(9, seed=15)]

    def run(reqs: list[Request]) -> Outcome:
        config = make_config(prefix_cache=False)
        sched = Scheduler(config)
        worker = make_worker(loaded, config.n_cells, batch_invariant=True, lora=loras)
        outcome = Outcome()
        for r in reqs:
            sched.add_request(r)
        while sched.has_work:
            step(sched, worker, outcome)  # type: ignore[arg-type]
        return outcome

    def reqs() -> list[Request]:
        return [request("l", prompts[0], ((0, 1.0),)), request("b", prompts[1])]

    together = run(reqs())
    for r in reqs():
        assert together.tokens[(r.req_id, 0)] == run([r]).tokens[(r.req_id, 0)]
    plain = run([request("l", prompts[0])])
    assert together.tokens[("l", 0)] != plain.tokens[("l", 0)]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gemma3", "rslora"])
def test_other_blocks_and_rslora_match_peft(kind: str, tmp_path: Path) -> None:
    """q/k/v biases (Qwen2), q/k norms and head_dim != dim / n_heads (Qwen3), Gemma 3 (GeGLU,
    sliding windows, its norms), and rsLoRA's alpha / sqrt(r): PEFT's logits and tokens."""
    if kind == "gemma3":
        base = write_tiny_gemma3(tmp_path / "base")
    elif kind == "rslora":
        base = write_tiny_llama(tmp_path / "base")
    else:
        base = write_tiny_llama(tmp_path / "base", model_type=kind, head_dim=24)
    extra = {"use_rslora": True} if kind == "rslora" else {}
    adapter = write_peft_adapter(base, tmp_path / "lora", seed=5, targets=ALL_PROJ, **extra)
    loaded = load_model(base)
    lora = load_lora(adapter, loaded.config, torch.float32)
    if kind == "rslora":
        assert all(w.scaling == 8 / 2 for w in lora.weights.values())  # alpha 8 / sqrt(4)
    kind_setup = (base, adapter, None, loaded, LoraSet(loaded.transformer, [lora]))
    prompt = make_prompt(14, seed=16)
    hf = hf_peft(base, adapter)
    if kind != "gemma3":  # (its two pools of cells: the plan below has one)
        plan = make_plan([prefill_chunk(0, prompt, 0, all_rows=True)])
        plan.seqs = [dataclasses.replace(s, lora=((0, 1.0),)) for s in plan.seqs]
        ours = worker_of(kind_setup).forward(plan)
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, theirs, atol=3e-4, rtol=1e-4)
    spec = loaded.config.memory_spec
    out, _, _ = serve(kind_setup, [[request("r", prompt, ((0, 1.0),))]], memory_spec=spec)
    assert out.tokens[("r", 0)] == hf_greedy(hf, prompt, 12)


def test_bfloat16_model_applies_the_adapter(setup: tuple) -> None:
    """bfloat16 activations: the adapter's effect on the logits is PEFT's (float32) within
    bfloat16's rounding, far inside the effect itself."""
    base, a_path, *_ = setup
    loaded = load_model(base, dtype="bfloat16")
    lora = load_lora(a_path, loaded.config, torch.bfloat16)
    bf16_setup = (base, a_path, None, loaded, LoraSet(loaded.transformer, [lora]))
    prompt = make_prompt(9, seed=17)
    plan = make_plan([prefill_chunk(0, prompt, 0, all_rows=True)])
    plain = worker_of(bf16_setup).forward(plan)
    plan.seqs = [dataclasses.replace(s, lora=((0, 1.0),)) for s in plan.seqs]
    ours = worker_of(bf16_setup).forward(plan) - plain
    with torch.no_grad():
        hf_plain = hf_peft(base, None)(torch.tensor([prompt])).logits[0]
        theirs = hf_peft(base, a_path)(torch.tensor([prompt])).logits[0] - hf_plain
    err = (ours - theirs).abs().max().item()
    assert err < 0.05 * theirs.abs().max().item()


@pytest.mark.parametrize("gather", [False, True])
def test_adapters_reattached_under_their_served_ids(
    setup: tuple, gather: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime load or unload (server/lora_runtime.py) re-attaches the adapters under the ids
    they are served with, holes included: adapter b as id 7 gives what it gives as id 1, and an
    id no longer attached is an error, never the base model."""
    base, a_path, b_path, loaded, loras = setup
    if gather:
        monkeypatch.setattr("model.layers.lora.ALL_ADAPTERS_MAX_COLS", 0)
    prompt = make_prompt(11, seed=9)
    want, _, _ = serve(setup, [[request("r", prompt, ((1, 1.0),))]])
    fresh = load_model(base)
    args, dtype = fresh.config, fresh.transformer.dtype
    first = LoraSet(fresh.transformer, [load_lora(a_path, args, dtype)])
    first.detach()
    sparse = {3: load_lora(a_path, args, dtype), 7: load_lora(b_path, args, dtype)}
    lora = LoraSet(fresh.transformer, sparse)
    got, _, _ = serve((base, a_path, b_path, fresh, lora), [[request("r", prompt, ((7, 1.0),))]])
    assert got.tokens == want.tokens
    with pytest.raises(LookupError, match="id 1 is not loaded"):
        lora.batch([SeqBatch(0, 0, 4, ((1, 1.0),))], fresh.transformer.device)
    lora.detach()
    assert not any(isinstance(m, LoraLinear) for m in fresh.transformer.modules())
