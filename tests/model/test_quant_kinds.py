"""Which kernel a QuantLinear runs, by its kind, row count and activation dtype: every case gives
the bits of the explicit kernel call it made when the table was written out in Python
(QuantLinear.forward), and the one-call step's kinds (model/runner/native.py) stay what they
were. The step's outputs equal the Python layers' bit for bit: tests/model/test_native.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from model.layers.quant import INT4_GROUP, QuantLinear, dense_linear
from model.runner import native
from tests.model.factories import require_kernels

pytestmark = pytest.mark.model

# name -> (kind, takes the kernels module): "int4_f32" is int4 on cellserve's integer kernels
SETUPS = {
    "int4": ("int4", False),
    "int8": ("int8", False),
    "fbgemm8": ("fbgemm8", False),
    "int4_f32": ("int4", True),
    "q8": ("q8", True),
}


def make_linear(setup: str, bias: bool, dense: torch.dtype) -> QuantLinear:
    kind, with_kernels = SETUPS[setup]
    torch.manual_seed(7)
    w, b = torch.randn(80, 96) * 0.1, torch.randn(80) if bias else None
    return QuantLinear(w, b, kind, dense, require_kernels() if with_kernels else None)


def plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def reference(lin: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernel call each case made, spelled out (x [rows, k])."""
    rows, k = x.shape[0], require_kernels() if lin.kind == "q8" or lin.dense is None else None
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
}


@pytest.mark.parametrize("setup, dtype", list(STEP_KINDS))
def test_the_one_call_step_takes_the_same_kinds(setup, dtype):
    lin = make_linear(setup, True, torch.bfloat16)
    assert native._step_kind(lin, dtype) == STEP_KINDS[setup, dtype]
