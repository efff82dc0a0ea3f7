"""Which kernel a QuantLinear runs, by its kind, row count and activation dtype: every case gives
the bits of the explicit kernel call it made when the table was written out in Python
(QuantLinear.forward), and the one-call step's kinds (model/runner/native.py) stay what they
were. The step's outputs equal the Python layers' bit for bit: tests/model/test_native.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from model.layers.quant import INT4_GROUP, QuantLinear, dense_linear
from model.runner import native
from tests.model.factories import require_kernels

pytestmark = pytest.mark.model

# name -> (kind, takes the kernels module, integer_rows): "int4_f32" is int4 on cellserve's
# integer kernels (a float32 model's), "int4_bf16" and "int8_kernels" a bfloat16 model's linears
SETUPS = {
    "int4": ("int4", False, True),
    "int8": ("int8", False, True),
    "fbgemm8": ("fbgemm8", False, True),
    "int4_f32": ("int4", True, True),
    "q8": ("q8", True, True),
    "int4_bf16": ("int4", True, False),
    "int8_kernels": ("int8", True, False),
}


def make_linear(setup: str, bias: bool, dense: torch.dtype) -> QuantLinear:
    kind, with_kernels, integer_rows = SETUPS[setup]
    torch.manual_seed(7)
    w, b = torch.randn(80, 96) * 0.1, torch.randn(80) if bias else None
    kernels = require_kernels() if with_kernels else None
    return QuantLinear(w, b, kind, dense, kernels, integer_rows)


def plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def reference(lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernel call each case made, spelled out (x [rows, k])."""
    rows = x.shape[0]
    k: Any = require_kernels() if lin.kind == "q8" or lin.dense is None else None
    if lin.kind == "int4" and lin.dense is None:  # int4_mm / int4_gemm's own copies
        if x.dtype != torch.float32:  # bfloat16 rows: torch's kernel at every row count
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.packed, INT4_GROUP, lin.scales)
            return plus(y, lin.bias)
        if rows <= lin.small_rows:
            return plus(k.int4_mm(x, lin.q4, lin.q4_scale_min), lin.kernel_bias)
        return plus(k.int4_gemm(x, lin.q4_gemm, lin.q4.shape[0]), lin.kernel_bias)
    if rows > lin.small_rows:  # the dense copy of the quantized weights
        assert lin.dense is not None
        xd = x.to(lin.dense_dtype)
        return dense_linear(xd, lin.dense, lin.dense_bias, lin.dense_packed).to(x.dtype)
    if lin.kind == "fbgemm8":
        y = torch.cat(
            [
                torch.ops.quantized.linear_dynamic(r, lin.packed, lin.reduce_range)
                for r in x.float().split(1)
            ]
        )
        return y.to(x.dtype)
    if lin.kind == "q8":  # int8_mm takes float32 rows
        return plus(k.int8_mm(x.float(), lin.q8, lin.q8_scale), lin.kernel_bias).to(x.dtype)
    xb = x.bfloat16()  # torch's int4 / int8 kernels take bfloat16 rows
    if lin.kind == "int4":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, lin.packed, INT4_GROUP, lin.scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(xb, lin.packed, lin.scales)
    return plus(y, lin.bias).to(x.dtype)


ROWS: dict[str, Callable[[QuantLinear], int]] = {
    "one": lambda lin: 1,
    "small_rows": lambda lin: lin.small_rows,
    "past_small_rows": lambda lin: lin.small_rows + 3,
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dense", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_each_kind_runs_the_kernel_of_its_rows(setup, x_dtype, dense, bias):
    lin = make_linear(setup, bias, dense)
    torch.manual_seed(8)
    x = torch.randn(lin.small_rows + 3, 96).to(x_dtype)
    for name, rows in ROWS.items():
        xs = x[: rows(lin)]
        y = lin(xs)
        assert y.dtype == x_dtype and y.shape == (len(xs), 80)
        assert torch.equal(y, reference(lin, xs)), (setup, name)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_batch_invariant_linear_takes_one_kernel_at_every_row_count(setup):
    """small_rows 0 (model/runner/worker.py batch_invariant): the dense copy (int4_f32:
    int4_gemm) from the first row, set after the linear has already run."""
    lin = make_linear(setup, True, torch.bfloat16)
    torch.manual_seed(9)
    for x_dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 96).to(x_dtype)
        lin(x[:1])
        lin.small_rows = 0
        for rows in (1, 3):
            assert torch.equal(lin(x[:rows]), reference(lin, x[:rows])), (setup, x_dtype, rows)
        lin.small_rows = 2
        assert torch.equal(lin(x[:1]), reference(lin, x[:1]))


STEP_KINDS = {  # (setup, the model's dtype) -> the kind step_layers runs the linear as
    ("int4", torch.bfloat16): "int4",
    ("int4", torch.float32): None,  # rows round to bfloat16 for torch's kernel: Python
    ("int8", torch.bfloat16): "int8",
    ("int8", torch.float32): "int8",
    ("fbgemm8", torch.bfloat16): None,
    ("fbgemm8", torch.float32): None,
    ("int4_f32", torch.float32): "int4_f32",
    ("q8", torch.float32): "q8",
    ("q8", torch.bfloat16): None,
    ("int4_bf16", torch.bfloat16): "int4",
    ("int4_bf16", torch.float32): None,
    ("int8_kernels", torch.bfloat16): "int8",
    ("int8_kernels", torch.float32): "int8",
    # NOTE: was "int4", a StepLinear without the dense copy past small_rows (no model has it:
    # quantize() gives int4_f32 linears to float32 models only); forward's torch kernel instead
    ("int4_f32", torch.bfloat16): None,
}


@pytest.mark.parametrize("setup, dtype", list(STEP_KINDS))
def test_the_one_call_step_takes_the_same_kinds(setup, dtype):
    lin = make_linear(setup, True, torch.bfloat16)
    assert native._step_kind(lin, dtype) == STEP_KINDS[setup, dtype]


class CountingKernels:
    """The kernels module, counting quant_linear's calls."""

    def __init__(self, kernels: Any) -> None:
        self.kernels, self.calls = kernels, 0

    def quant_linear(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        y: torch.Tensor = self.kernels.quant_linear(*args)
        return y

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernels, name)


@pytest.mark.parametrize("setup", [s for s, (_, with_kernels, _) in SETUPS.items() if with_kernels])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_forward_runs_the_step_kernel_wherever_the_kind_has_one(setup, x_dtype):
    """One table: forward calls the kernels' quant_linear, the one-call step's, for every
    (kind, dtype) step_kind names, with the StepLinear the step takes; the kernel's own call
    gives the same bits."""
    lin = make_linear(setup, True, torch.bfloat16)
    kernels = require_kernels()
    counting = lin.kernels = CountingKernels(kernels)
    torch.manual_seed(10)
    x = torch.randn(lin.small_rows + 3, 96).to(x_dtype)
    kind = lin.step_kind(x_dtype)
    for rows in (1, lin.small_rows, lin.small_rows + 3):
        before = counting.calls
        y = lin(x[:rows])
        assert torch.equal(y, reference(lin, x[:rows]))
        took = counting.calls - before
        if kind is not None:
            assert took == 1
            w = lin.step_linear(kernels, x_dtype)
            assert w is not None and w.kind == kind and w.small_rows == lin.small_rows
            assert torch.equal(kernels.quant_linear(x[:rows], w, INT4_GROUP), y)
        else:  # forward's Python: the dense copy, or the rows cast to a dtype the kind has
            through = lin.step_kind(torch.float32 if lin.kind == "q8" else torch.bfloat16)
            assert took == (rows <= lin.small_rows and through is not None)


def test_quantize_gives_a_bfloat16_model_the_kernels_and_no_integer_rows(smollm_path):
    from model import load_model
    from model.layers.quant import quantize

    kernels = require_kernels()
    for dtype in ("bfloat16", "float32"):
        loaded = load_model(smollm_path, dtype=dtype)
        quantize(loaded.transformer, "int4")
        linears = [m for m in loaded.transformer.modules() if isinstance(m, QuantLinear)]
        assert all(m.kernels is kernels for m in linears)
        head = loaded.transformer.output
        assert isinstance(head, QuantLinear)
        if dtype == "bfloat16":
            assert head.kind == "fbgemm8" and not any(m.int4_f32 for m in linears)
        else:
            assert head.kind == "q8" and all(m.int4_f32 for m in linears if m is not head)
