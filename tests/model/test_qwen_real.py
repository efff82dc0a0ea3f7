"""The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M (model/load/packaged.py) on its own GGUF blocks
(`--quant gguf`, model/layers/ggml.py): nothing dense is kept, and the logits stay close to the
float32 reference of the same weights (dequantized, `--quant none --dtype float32`)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model.kernels import load_kernels
from model.layers.ggml import BlockLinear, has_block_kernels, weight_bytes
from model.load.packaged import QWEN25_CODER_05B
from model.runner.worker import make_worker
from model.serving import open_model
from tests.model.factories import Driver
from tests.model.test_forward import TEXTS

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def qwen_path():
    if not QWEN25_CODER_05B.installed():
        reason = f"Qwen2.5-Coder-0.5B is not installed: {QWEN25_CODER_05B.install}"
        if os.environ.get("CELLSERVE_REQUIRE_TOOLS") == "1":
            pytest.fail(reason + " (CELLSERVE_REQUIRE_TOOLS=1)")
        pytest.skip(reason)
    if not has_block_kernels(load_kernels()):
        pytest.skip("the C++ kernels are not built (make install)")
    return QWEN25_CODER_05B.path()


def pages_present(t: torch.Tensor) -> int:
    """Whole pages of `t`'s bytes present in this process's page tables (/proc/self/pagemap's
    bit 63, readable without privileges)."""
    page = os.sysconf("SC_PAGESIZE")
    start = -(-t.data_ptr() // page)
    end = (t.data_ptr() + t.numel() * t.element_size()) // page
    if end <= start:
        return 0
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = np.frombuffer(f.read((end - start) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


def all_logits(opened, prompts: list[list[int]]) -> torch.Tensor:
    worker = make_worker(opened.loaded, n_cells=2048)
    out = []
    for ids in prompts:
        driver = Driver(worker, worker.storage.n_cells, seed=len(ids))
        out.append(driver.logits([driver.chunk(0, ids, all_rows=True)]).float())
    return torch.cat(out)


@pytest.fixture(scope="module")
def reference(qwen_path):
    opened = open_model(qwen_path, "cpu", dtype="float32", quant="none")
    prompts = [opened.loaded.tokenizer.encode(t) for t in TEXTS]
    return prompts, all_logits(opened, prompts)


def test_the_default_serves_the_files_own_blocks_mapped(qwen_path):
    opened = open_model(qwen_path, "cpu")
    assert opened.runtime.quant == "gguf", opened.runtime.reason
    model = opened.loaded.transformer
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert len(linears) == 24 * 4 + 1  # wqkv, wo, w13, w2 a layer, and the head
    mapped, owned = weight_bytes(model)
    # every linear and the embedding table: views of the file (the norms and biases are owned),
    # but the parts this build repacks (Q4_K on AVX-512 VNNI: ggml_repack), held as their copy
    repacked = sum(d.numel() for lin in linears for _, d in lin.repacked())
    assert (repacked > 0) == (12 in load_kernels().ggml_repack_types())
    assert mapped + repacked > 0.95 * qwen_path.stat().st_size
    assert owned - repacked < 0.01 * mapped
    # the file's pages a repack read are released: none of a repacked weight's whole pages is in
    # this process's page tables, where reading a weight (the head, below) puts its pages there
    moved = [w.data for lin in linears for w, _ in lin.repacked()]
    assert all(pages_present(w) == 0 for w in moved)
    head = linears[-1].weights[0].data
    assert head.sum(dtype=torch.int64) > 0 and pages_present(head) > 0.9 * head.numel() / 4096 - 2
    worker = make_worker(opened.loaded, n_cells=256)
    assert worker.paths.native is not None, worker.paths.describe()
    # Q4_K_M: Q4_K with Q6_K in some layers' w2 / wv and the head; each on ggml_linear
    linears = worker.paths.linears
    assert sum(linears.values()) == 24 * 4 + 1, linears
    assert all(way.startswith("C++ ggml_linear ") for way in linears), linears
    # its prompt chunks on AMX tiles exactly where the CPU has them (ggml_kamx.h)
    amx = bool(getattr(load_kernels(), "ggml_amx", lambda: False)())
    assert worker.paths.amx == amx and ("AMX tiles" in worker.paths.describe()) == amx


@pytest.mark.parametrize(
    ("dtype", "min_top1", "max_kl"), [("float32", 0.99, 0.002), ("bfloat16", 0.97, 0.01)]
)
def test_logits_stay_close_to_the_float32_reference(qwen_path, reference, dtype, min_top1, max_kl):
    prompts, ref = reference
    ours = all_logits(open_model(qwen_path, "cpu", dtype=dtype, quant="gguf"), prompts)
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = F.kl_div(
        ours.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean"
    ).item()
    assert ours.shape == ref.shape and ours.shape[0] > 400
    assert top1 >= min_top1 and kl <= max_kl, (top1, kl)


def test_the_real_coder_fills_in_the_middle_and_chats(qwen_path):
    """/infill and completions' suffix on the real Qwen2.5-Coder's FIM tokens, and a chat
    through its own template, on the default setup (the file's blocks)."""
    import httpx

    from tests.live_server import start_server

    live = start_server(model=str(qwen_path), n_cells=2048, ctx_per_seq=1024)
    try:
        # llama.cpp's llama-server /infill on the same file answers "math.pi * radius ** 2"
        prefix = "import math\n\ndef area_of_circle(radius):\n    return "
        suffix = "\n\n\nprint(area_of_circle(2.0))\n"
        body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 24, "temperature": 0}
        infill = httpx.post(f"{live.url}/infill", json=body, timeout=120)
        assert infill.status_code == 200, infill.text
        middle = infill.json()["content"]
        assert middle.startswith("math.pi * radius ** 2"), middle
        props = httpx.get(f"{live.url}/metrics").text
        assert 'quant="gguf"' in props
        chat = httpx.post(
            f"{live.url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "What is 2 + 3? Answer with a number."}],
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=120,
        )
        assert chat.status_code == 200, chat.text
        assert "5" in chat.json()["choices"][0]["message"]["content"]
    finally:
        live.stop()


def test_code_that_spells_special_tokens_stays_text_in_a_middle(qwen_path):
    """As llama.cpp's format_prompt_infill: the prefix, suffix and extra files are text, so a
    file holding "<|fim_prefix|>" or "<|endoftext|>" cannot inject those tokens; `prompt`
    still reads special tokens."""
    from model.load import gguf as gguf_loader
    from model.load.tokenizer import Tokenizer
    from server.fim import ExtraChunk, fim_tokens, fim_window, infill_ids

    reader = gguf_loader.open_gguf(qwen_path)
    fields = {k: v for k, v in reader.fields.items() if k.startswith("tok")}
    tok = Tokenizer.from_gguf(fields, qwen_path, "qwen2")
    fim = fim_tokens(tok, "qwen", "input_prefix")
    eot = tok.encode("<|endoftext|>", add_special=False)
    assert len(eot) == 1 and eot[0] in tok.special_ids  # it is a special token
    code = 'TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|endoftext|>"]\n'
    plain = tok.encode(code, add_special=False, parse_special=False)
    assert tok.decode(plain) == code and not set(plain) & (tok.special_ids | {fim.pre, fim.suf})
    extra = [ExtraChunk("tokens.py", code)]
    ids = infill_ids(tok, fim, code, code, extra, "<|endoftext|>", fim_window(1024, 16))
    assert ids.count(fim.pre) == 1 and ids.count(fim.suf) == 1 and ids.count(fim.mid) == 1
    assert ids.count(eot[0]) == 1  # the prompt's (it follows the prefix)
