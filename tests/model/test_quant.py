"""--quant int4/int8: the quantized SmolLM2 stays close to float32, on both kernel paths."""

from __future__ import annotations

import pytest
import torch

from model import load_model
from model.layers.decoder import Linear
from model.layers.quant import (
    SMALL_ROWS,
    QuantLinear,
    dense_linear,
    pack_dense,
    quantize,
    quantize_int4,
)
from model.runner.worker import make_worker
from tests.model.factories import SeqChunk, make_plan, prefill_chunk

pytestmark = pytest.mark.model

TEXT = (
    "The history of the Roman Empire spans many centuries. It began when Augustus became the "
    "first emperor in 27 BC and, in the West, ended in 476 AD. During this time the empire built "
    "roads, aqueducts and cities across Europe, North Africa and the Middle East."
)


def decode_logits(worker, ids: list[int]) -> torch.Tensor:
    """Teacher-forced, one token per step: every Linear sees a single row (the small path)."""
    rows = []
    for i, t in enumerate(ids):
        chunk = SeqChunk(0, [t], [i], [i], list(range(i + 1)), list(range(i + 1)))
        rows.append(worker.forward(make_plan([chunk])))
    return torch.cat(rows)


def prompt_logits(worker, ids: list[int]) -> torch.Tensor:
    """All rows in one batch (past SMALL_ROWS: the bfloat16 path)."""
    return worker.forward(make_plan([prefill_chunk(0, ids, 0, all_rows=True)]))


def closeness(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """-> (top-1 agreement, mean KL(ref || ours))."""
    agree = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    kl = torch.nn.functional.kl_div(
        ours.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    return agree, float(kl)


@pytest.fixture(scope="module")
def ids(smollm) -> list[int]:
    return smollm.tokenizer.encode(TEXT)


@pytest.fixture(scope="module")
def reference(smollm, ids) -> torch.Tensor:
    return prompt_logits(make_worker(smollm, n_cells=128), ids)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_logits_stay_close_to_float32(smollm_path, ids, reference, mode):
    loaded = load_model(smollm_path, dtype="float32")
    quantize(loaded.transformer, mode)
    assert not any(isinstance(m, Linear) for m in loaded.transformer.modules())
    worker = make_worker(loaded, n_cells=128)
    assert len(ids) > SMALL_ROWS
    for ours in (decode_logits(worker, ids), prompt_logits(worker, ids)):
        agree, kl = closeness(ours, reference)
        assert agree >= 0.9 and kl < 0.02, (mode, agree, kl)


def test_none_leaves_the_model_untouched(smollm):
    before = list(smollm.transformer.modules())
    assert quantize(smollm.transformer, "none") is smollm.transformer
    assert list(smollm.transformer.modules()) == before


def test_unknown_mode_is_refused(smollm):
    with pytest.raises(ValueError, match="int3"):
        quantize(smollm.transformer, "int3")


def test_int4_recovers_weights_on_a_4_bit_grid():
    torch.manual_seed(0)
    scale = torch.rand(8, 4, 1) * 0.1 + 0.01
    low = torch.randn(8, 4, 1)
    q = torch.randint(0, 16, (8, 4, 32))
    q[..., 0], q[..., 1] = 0, 15  # every group spans its whole grid
    w = (low + q * scale).view(8, 128)
    q_out, scales_zeros = quantize_int4(w)
    scale_out, zero = scales_zeros[..., 0].T, scales_zeros[..., 1].T  # [n, groups]
    back = (q_out.view(8, 4, 32) - 8) * scale_out[..., None] + zero[..., None]
    torch.testing.assert_close(back.view(8, 128), w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["int4", "int8", "fbgemm8"])
def test_small_and_large_batches_agree(kind):
    torch.manual_seed(1)
    w, b = torch.randn(64, 96) * 0.1, torch.randn(64)
    lin = QuantLinear(w, b, kind)
    x = torch.randn(SMALL_ROWS + 4, 96)
    ref = torch.nn.functional.linear(x, w, b)
    assert lin(x).shape == ref.shape
    for y in (lin(x[:SMALL_ROWS]), lin(x)[:SMALL_ROWS]):
        err = float((y - ref[:SMALL_ROWS]).abs().max())
        assert err < 0.05 * float(ref.abs().max()), (kind, err)


def test_packed_dense_weights_give_the_plain_bfloat16_linear():
    """pack_dense (oneDNN's blocked layout) changes the speed of the large-batch path, not its
    values: row for row what F.linear gives on the bfloat16 weights, at any batch size."""
    torch.manual_seed(2)
    w, b = (torch.randn(160, 96) * 0.1).bfloat16(), torch.randn(160).bfloat16()
    packed, is_packed = pack_dense(w)
    if not torch.backends.mkldnn.is_available():
        assert not is_packed
    for rows in (1, 5, 33):
        x = torch.randn(rows, 96).bfloat16()
        want = torch.nn.functional.linear(x, w, b)
        assert torch.equal(dense_linear(x, packed, b, is_packed), want)


def test_the_server_default_is_the_fast_setup_for_this_cpu(smollm_path, tmp_path, monkeypatch):
    """No flags: a quantized GGUF is served quantized (4-bit types int4, 5-8-bit int8),
    bfloat16 only where the CPU computes it natively; flags win; a GPU keeps bfloat16."""
    from model.kernels import isa
    from model.load.loader import choose_runtime
    from tests.tiny_gguf import write_tiny_gguf
    from tests.tiny_models import write_tiny_llama

    native = "bfloat16" if isa.native_bfloat16() else "float32"
    auto = choose_runtime(smollm_path, "cpu")  # SmolLM2's Q4_1
    assert (auto.dtype, auto.quant) == (native, "int4")
    assert "Q4_1" in auto.reason and isa.active_level() in auto.reason
    ref = choose_runtime(smollm_path, "cpu", "float32", "none")
    assert (ref.dtype, ref.quant) == ("float32", "none")
    folder = write_tiny_llama(tmp_path / "hf")
    for qtype, quant in (("Q8_0", "int8"), ("Q4_0", "int4"), ("F32", "none"), ("F16", "none")):
        path = write_tiny_gguf(tmp_path / f"{qtype}.gguf", folder, qtype=qtype)
        assert choose_runtime(path, "cpu").quant == quant, qtype
    assert choose_runtime(folder, "cpu").quant == "none"  # a Hugging Face folder
    gpu = choose_runtime(smollm_path, "cuda")
    assert (gpu.dtype, gpu.quant) == ("bfloat16", "none")
    monkeypatch.setenv("CELLSERVE_ISA", "avx2")  # no native bfloat16 at this level
    assert choose_runtime(smollm_path, "cpu").dtype == "float32"


def test_float32_rows_take_the_integer_kernels():
    """With the kernels, a float32 int4 QuantLinear multiplies up to small_rows rows by int4_mm
    and more by int4_gemm (both int8 activations per group of 32, the same quantized weights,
    no dense copy); the int8 output head ("q8") up to its small_rows by int8_mm, more by its
    dense float32 copy. Bias included; each within the activations' int8 rounding of the
    float32 product with the quantized weights."""
    from model.layers.quant import SMALL_ROWS_F32, SMALL_ROWS_INT4, dequantize_int4, quantize_int4
    from tests.model.factories import require_kernels

    kernels = require_kernels()
    torch.manual_seed(4)
    w, b = torch.randn(64, 96) * 0.1, torch.randn(64)
    q, scales_zeros = quantize_int4(w)
    weights = {"int4": dequantize_int4(q, scales_zeros.bfloat16().float())}
    for kind in ("int4", "q8"):
        lin = QuantLinear(w, b, kind, torch.float32, kernels)
        assert lin.kernels is kernels
        x = torch.randn(SMALL_ROWS_F32 + 4, 96)
        if kind == "int4":
            assert lin.small_rows == SMALL_ROWS_INT4 and lin.dense is None
            batch = kernels.int4_gemm(x, lin.q4_gemm, 64) + b
            exact = x @ weights["int4"].T + b
        else:
            assert lin.small_rows == SMALL_ROWS_F32 > SMALL_ROWS
            assert lin.dense.dtype == torch.float32
            batch = dense_linear(x, lin.dense, lin.dense_bias, lin.dense_packed)
            exact = batch
        assert torch.equal(lin(x), batch)  # past small_rows
        for rows in range(1, lin.small_rows + 1):
            y = lin(x[:rows])
            assert y.dtype == torch.float32
            want = (
                kernels.int4_mm(x[:rows], lin.q4, lin.q4_scale_min)
                if kind == "int4"
                else kernels.int8_mm(x[:rows], lin.q8, lin.q8_scale)
            )
            assert torch.equal(y, want + b)
        # the integer kernels' outputs (int8 activations): near the float32 product, not equal
        for y in [lin(x[: lin.small_rows])] + ([lin(x)] if kind == "int4" else []):
            err = float((y - exact[: len(y)]).abs().max())
            assert 0 < err < 0.02 * float(exact.abs().max()), (kind, len(y), err)
