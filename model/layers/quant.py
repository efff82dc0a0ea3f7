"""Weight-only quantization of the Transformer's Linear layers (`--quant`; the server default
for a quantized GGUF on CPU: model.load.loader.choose_runtime).

"int4": group-wise (32) asymmetric 4-bit weights, w = (q - 8) * scale + zero, q in [0, 15].
Group 32 is the GGUF Q4_0/Q4_1 block, so a Q4_1 file's weights come back onto their own grid
(only the bfloat16 scales round). The output head keeps 8 bits (GGUF heads are usually
Q8_0/Q6_K; 4 bits would move the logits).
- bfloat16 activations (the default where the CPU computes bfloat16 natively: AVX-512 BF16,
  AMX): torch's `_weight_int4pack_mm_for_cpu`; the head through fbgemm's dynamic int8 linear,
  one row at a time (its activation scale is per call, so per token).
- float32 activations (the default elsewhere, e.g. AVX2), where the C++ kernels are built:
  `int4_mm` (model/kernels/int4.cpp) for small batches on a copy of the weights in its own
  layout (`pack_int4`), `int4_gemm` (gemm.cpp) for larger ones on another (`pack_int4_gemm`,
  unsigned bytes interleaved by 8 outputs for a GEMM micro-kernel), and the head as "q8"
  (`quantize_q8`, int8 with a scale per 32, `int8_mm`): all quantize the activations to int8
  per group of 32 and sum each group exactly in integers, as llama.cpp multiplies Q4_1 / Q8_0
  weights. Without the kernels the rows are rounded to bfloat16 for torch's kernel (emulated
  there) and the head takes fbgemm.
"int8": with float32 activations, where the C++ kernels are built, "q8" for every layer (int8
weights with a scale per 32 along k, GGUF's Q8_0, times int8 activations per 32 in `int8_mm`:
llama.cpp's Q8_0 x Q8_0); otherwise symmetric int8 per output channel through torch's
`_weight_int8pack_mm` (bfloat16 rows: emulated, and slow, without AVX-512 BF16).
Both change the logits a little (the server says so; docs/performance.md). Batches of more than
`small_rows` rows use a dense copy of the quantized weights instead (but int4 with float32
rows: int4_gemm), prepacked for oneDNN (`pack_dense`): past ~4 rows the quantized CPU kernels
lose to the bfloat16 GEMM on AVX-512, past ~32 int8_mm to the float32 one. That copy is
bfloat16 where the CPU computes bfloat16 natively, float32 elsewhere (`dense_dtype`).
Which kernel runs a QuantLinear, by its kind, row count and activation dtype, is written once:
model/kernels/step.cpp `quant_linear`, which forward calls for every kind it has for the rows'
dtype (`step_kind`) and the one-call step for each of its linears (model/runner/native.py);
forward keeps in Python fbgemm8, the kinds that go through another dtype first, and models
quantized without the kernels.
fbgemm's dynamic int8 over whole batches was tried for every layer and dropped: one activation
scale per batch cost SmolLM2-135M half of its top-1 agreement with float32; one per row (what
torch._int_mm would take; simulated on the whole-text logits, forced AVX2 path) a top-1 of 0.93
and a KL of 0.039, against 0.98 / 0.003 with a scale per group of 32.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.kernels import isa, load_kernels
from model.layers.decoder import Linear, Transformer

QUANT_MODES: tuple[str, ...] = ("none", "int8", "int4", "gguf")
INT4_GROUP = 32
# SmolLM2's 30 layers, cold weights, 2 threads (ms): rows 4: int4 6.5, packed bf16 9.7;
# rows 6: 11.4 vs 9.8; rows 8: 11.7 vs 11.7; rows 16: 21.7 vs 15.0.
SMALL_ROWS = 4
# Float32 rows (model/kernels: integer dot products on int8 activations) take int4_mm up to
# SMALL_ROWS_INT4 rows and int4_gemm past it (no dense copy); the q8 head int8_mm up to
# SMALL_ROWS_F32 rows, its dense float32 copy (oneDNN) past it.
# `CELLSERVE_ISA=avx2 python -m bench.int4_bench` on the idle Zen 4, 2 threads (ms): SmolLM2's
# 30 layers int4_mm / int4_gemm / dense float32 at 1 row 4.0 / - / 22.5 (earlier run), 8: 13.3 /
# 13.1 / 29.8, 16: 24.9 / 19.7 / 38.2, 32: 50.0 / 21.8 / 58.9, 512: - / 276 / 565; its
# 49152 x 576 head int8_mm vs dense at 1 row 1.8 vs 4.6 (fbgemm's per-row int8: 1.5), 4: 1.6 vs
# 4.5, 32: 11.8 vs 11.7. Each kernel gives a row the same values at any row count; a
# batch_invariant worker sets small_rows to 0 (model/runner/worker.py): one kernel at every
# row count.
SMALL_ROWS_INT4 = 8
SMALL_ROWS_F32 = 32


def pack_dense(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A bfloat16 [n, k] weight -> (weight for dense_linear, packed). oneDNN's blocked layout
    skips the reorder F.linear does on every call: at 32 rows SmolLM2's 30 layers ran 23.7 vs
    31.0 ms (cold), the head 5.8 vs 7.6, with equal results. Unpacked where oneDNN is absent."""
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return w, False
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, None), True
    except (AttributeError, RuntimeError):  # an older build without the op
        return w, False


def dense_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, packed: bool
) -> torch.Tensor:
    if packed:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, k] -> int8 [n, k], scales [n] float32 with w ~= int8 * scales[:, None]."""
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def pack_int4(q: torch.Tensor, scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int4's q [n, k], scales_zeros [k / group, n, 2] -> int4_mm's operands: [n, k / 2]
    uint8, per group of 32 byte j = q[j] | q[16 + j] << 4, and [n, 2, k / group] float32 (each
    row's scales, then its minimums zero - 8 * scale): w = q * scale + min
    (model/kernels/int4.cpp)."""
    n, k = q.shape
    qg = q.view(n, k // INT4_GROUP, 2, INT4_GROUP // 2).to(torch.uint8)
    packed = (qg[:, :, 0] | (qg[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    sz = scales_zeros.float().permute(1, 2, 0)  # [n, 2, groups]
    scale_min = torch.stack((sz[:, 0], sz[:, 1] - 8.0 * sz[:, 0]), dim=1)
    return packed, scale_min.contiguous()


def pack_int4_gemm(q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """quantize_int4's q [n, k], scales_zeros [k / group, n, 2] -> int4_gemm's operand
    [n8 / 8, k / 32, 320] uint8, n8 = n rounded up to 8 (zero weights and scales pad it): per
    block of 8 outputs and group of 32 along k, 8 steps of 4 consecutive k, each the 8 outputs'
    4 values (256 bytes), then the 8 float32 scales and the 8 minimums (64 bytes)
    (model/kernels/gemm.cpp)."""
    n, k = q.shape
    n8, groups = -(-n // 8) * 8, k // INT4_GROUP
    qp = torch.zeros(n8, k, dtype=torch.uint8)
    qp[:n] = q.to(torch.uint8)
    # [block, i, group, step, 4] -> [block, group, step, i, 4]
    values = qp.view(n8 // 8, 8, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(n8 // 8, groups, 256)
    sz = scales_zeros.float()  # [groups, n, 2]
    sm = torch.zeros(groups, n8, 2)
    sm[:, :n, 0] = sz[..., 0]
    sm[:, :n, 1] = sz[..., 1] - 8.0 * sz[..., 0]
    # [group, block, i, 2] -> [block, group, 2, i]
    sm = sm.view(groups, n8 // 8, 8, 2).permute(1, 0, 3, 2).contiguous()
    return torch.cat((values, sm.view(n8 // 8, groups, 16).view(torch.uint8)), dim=-1).contiguous()


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What int4_mm does to its float32 rows first: x [m, k] -> int8 [m, k], per group of 32 the
    scale d = max|x| / 127 [m, k / 32] and d * the sum of the group's int8 values [m, k / 32]
    (the reference for tests)."""
    m, k = x.shape
    g = x.float().view(m, k // INT4_GROUP, INT4_GROUP)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None]).to(torch.int8).view(m, k)
    d = amax / 127.0
    return q, d, d * q.view(m, k // INT4_GROUP, INT4_GROUP).sum(-1).float()


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, k] -> int8 [n, k] in [-127, 127], scales [n, k / 32] float32, w ~= int8 * scale per
    group of 32 along k (GGUF's Q8_0): int8_mm's operands (model/kernels/int8.cpp)."""
    n, k = w.shape
    if k % INT4_GROUP != 0:
        raise ValueError(f"q8 needs in_features divisible by {INT4_GROUP}, got {k}")
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    scale = g.abs().amax(-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return q, scale.contiguous()


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, k] -> q [n, k] int32 in [0, 15], scales_zeros [k / group, n, 2] float32 with
    w ~= (q - 8) * scale + zero per group of INT4_GROUP along k."""
    n, k = w.shape
    if k % INT4_GROUP != 0:
        raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
    wg = w.view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((wg - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8.0 * scale
    scales_zeros = torch.stack((scale.view(n, -1), zero.view(n, -1)), dim=-1)
    return q, scales_zeros.transpose(0, 1).contiguous()


def dequantize_int4(q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """quantize_int4's inverse: q [n, k], scales_zeros [k / group, n, 2] -> w [n, k] float32."""
    n, k = q.shape
    scale, zero = scales_zeros[..., 0].T, scales_zeros[..., 1].T  # [n, groups]
    w = (q.view(n, k // INT4_GROUP, INT4_GROUP) - 8) * scale[..., None] + zero[..., None]
    return w.view(n, k)


class QuantLinear(nn.Module):
    """y = x @ W.T + b: a quantized kernel for small batches, bfloat16 for large ones."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kind: str,
        dense_dtype: torch.dtype = torch.bfloat16,
        kernels: Any | None = None,
        integer_rows: bool = True,
    ) -> None:
        """`kernels`: the model.kernels module: its quant_linear runs every (kind, rows' dtype)
        it has (step_kind). `integer_rows`: float32 rows take its integer kernels (int4:
        int4_mm / int4_gemm on their own copies; quantize() sets it for float32 models)."""
        super().__init__()
        w = weight.detach().float()
        self.kind = kind
        self.kernels: Any | None = kernels if has_linear_kernels(kernels) else None
        # int4 with float32 rows on int4_mm / int4_gemm (q4, q4_scale_min, q4_gemm), no dense copy
        self.int4_f32 = False
        self.dense_dtype = dense_dtype
        self.bias = None if bias is None else bias.detach().bfloat16()
        self.dense_bias = None if bias is None else bias.detach().to(dense_dtype)
        self._steps: dict[torch.dtype, tuple[Any, Any]] = {}  # step_linear's, per rows' dtype
        if kind == "fbgemm8":
            self.reduce_range = not isa.int8_vnni()
            int8, scales = quantize_int8(w)
            with warnings.catch_warnings():  # qint8 tensors are deprecated; fbgemm still takes them
                warnings.simplefilter("ignore", UserWarning)
                qweight = torch._make_per_channel_quantized_tensor(
                    int8, scales.double(), torch.zeros_like(scales, dtype=torch.int64), 0
                )
            b = None if bias is None else bias.detach().float()
            self.packed = torch.ops.quantized.linear_prepack(qweight, b)
            dequantized = int8.float() * scales[:, None]
        elif kind == "int4":
            q, scales_zeros = quantize_int4(w)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.scales = scales_zeros.bfloat16()
            dequantized = dequantize_int4(q, self.scales.float())
            if integer_rows and self.kernels is not None and hasattr(kernels, "int4_gemm"):
                # the bfloat16-rounded scales: the weights torch's kernel multiplies by
                self.q4, self.q4_scale_min = pack_int4(q, self.scales)
                self.q4_gemm = pack_int4_gemm(q, self.scales)
                self.kernel_bias = None if bias is None else bias.detach().float()
                self.int4_f32 = True
        elif kind == "q8":
            if self.kernels is None or not hasattr(kernels, "int8_mm"):
                raise ValueError("q8 takes the C++ kernels' int8_mm")
            self.q8, self.q8_scale = quantize_q8(w)
            self.kernel_bias = None if bias is None else bias.detach().float()
            k = w.shape[1]
            dequantized = (
                self.q8.float().view(-1, k // INT4_GROUP, INT4_GROUP) * self.q8_scale[..., None]
            ).view(-1, k)
        elif kind == "int8":
            self.packed, scales = quantize_int8(w)
            self.scales = scales.bfloat16()
            dequantized = self.packed.float() * self.scales.float()[:, None]
        else:
            raise ValueError(f"kind must be int4, int8, q8 or fbgemm8, got {kind!r}")
        # float32 rows on the integer kernels: more of them before the next kernel wins
        self.small_rows = SMALL_ROWS
        if self.int4_f32:
            self.small_rows = SMALL_ROWS_INT4
        elif kind == "q8":
            self.small_rows = SMALL_ROWS_F32
        # NOTE: the dense copy holds the quantized weights, not the original ones: both paths
        # then multiply by the same weights, and a sequence's greedy text does not change with
        # the row count of its step (a prompt re-read from the prefix cache computes its last
        # token alone, on the quantized kernel; the first time it ran in a large batch).
        # int4 with float32 rows has none: int4_gemm takes the batches.
        self.dense: torch.Tensor | None = None
        self.dense_packed = False
        if not self.int4_f32:
            self.dense, self.dense_packed = pack_dense(dequantized.to(dense_dtype))

    @property
    def small_rows(self) -> int:
        """Up to this many rows the quantized kernel, past them the dense copy (int4_f32:
        int4_gemm); 0 (a batch_invariant worker): one kernel at every row count."""
        return self._small_rows

    @small_rows.setter
    def small_rows(self, n: int) -> None:
        self._small_rows = n
        self._steps.clear()  # NOTE: each StepLinear holds the threshold

    def step_kind(self, dtype: torch.dtype) -> str | None:
        """The kind model/kernels' quant_linear (step.cpp, kernels.h StepLinear) runs this
        linear as for `dtype` rows, in forward and in the one-call step; None: forward's Python
        only (fbgemm8; q8 and int4_f32 on rows other than float32, torch's int4 on float32 rows:
        each through another dtype)."""
        if dtype == torch.float32 and self.int4_f32:
            return "int4_f32"
        if self.kind == "q8":
            return "q8" if dtype == torch.float32 else None
        if self.kind == "int4" and dtype == torch.bfloat16 and not self.int4_f32:
            return "int4"
        if self.kind == "int8" and dtype in (torch.bfloat16, torch.float32):
            return "int8"
        return None

    def step_linear(self, kernels: Any, dtype: torch.dtype) -> Any | None:
        """This linear as `kernels`' StepLinear for `dtype` rows (None: no step_kind), built
        once per dtype: its weights, biases and row threshold as quant_linear reads them."""
        kind = self.step_kind(dtype)
        if kind is None:
            return None
        built = self._steps.get(dtype)
        if built is not None and built[0] is kernels:
            return built[1]
        w = kernels.StepLinear()
        w.kind = kind
        if kind == "int4_f32":
            w.w0, w.w1, w.w2 = self.q4, self.q4_scale_min, self.q4_gemm
            w.bias = self.kernel_bias
        elif kind == "q8":
            w.w0, w.w1, w.w2 = self.q8, self.q8_scale, self.dense
            w.bias = self.kernel_bias
        else:
            w.w0, w.w1, w.w2 = self.packed, self.scales, self.dense
            w.bias = self.bias
        w.dense_bias = self.dense_bias
        w.small_rows = self.small_rows
        w.packed = self.dense_packed
        self._steps[dtype] = (kernels, w)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, in_features]
        if self.kernels is not None:
            step = self.step_linear(self.kernels, x.dtype)
            if step is not None:
                y: torch.Tensor = self.kernels.quant_linear(x, step, INT4_GROUP)
                return y
        # the kinds quant_linear does not run (step_kind), or a build without it
        if x.shape[0] > self.small_rows and self.dense is not None:
            y = dense_linear(x.to(self.dense_dtype), self.dense, self.dense_bias, self.dense_packed)
            return y.to(x.dtype)
        if self.kind == "fbgemm8":
            # NOTE: full 8-bit activations (reduce_range=False) measured closer to float32, but
            # only VNNI sums them exactly: AVX2's vpmaddubsw saturates its int16 pair sums
            # (a 64x96 layer 0.44 off instead of 0.02), so without VNNI 7-bit activations.
            rows = [
                torch.ops.quantized.linear_dynamic(r, self.packed, self.reduce_range)
                for r in x.float().split(1)
            ]
            return torch.cat(rows).to(x.dtype)
        if self.kind == "q8":  # int8_mm takes float32 rows
            return self.forward(x.float()).to(x.dtype)
        if x.dtype != torch.bfloat16:  # torch's int4 / int8 kernels take bfloat16 activations
            return self.forward(x.bfloat16()).to(x.dtype)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)
        return y if self.bias is None else y + self.bias


def has_linear_kernels(kernels: Any | None) -> bool:
    return kernels is not None and hasattr(kernels, "quant_linear")


def quantize(model: Transformer, mode: str, kernels: bool = True) -> Transformer:
    """Replace every Linear (attention, feed-forward, output head) in place; "none" is a no-op.
    `kernels` False: torch's kinds only, without model/kernels (what ran before them; benches
    compare the two). Float32 models take the kernels' integer ones (int4_f32, the q8 head)."""
    if mode in ("none", "gguf"):  # gguf: the loader kept the file's blocks (model/layers/ggml.py)
        return model
    if mode not in QUANT_MODES:
        raise ValueError(f"quant {mode!r} is not one of {', '.join(QUANT_MODES)}")
    if model.device.type != "cpu":
        raise ValueError(f"quant {mode!r} is CPU-only (the model is on {model.device})")
    dense = dense_dtype(model.dtype)
    module = load_kernels() if kernels else None
    integer_rows = model.dtype == torch.float32
    q8 = integer_rows and module is not None and hasattr(module, "int8_mm")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                # a reduced head's rows (decoder.ReducedHead) are the head's too
                head = (parent is model and name == "output") or getattr(parent, "is_head", False)
                kind = mode
                if head and mode == "int4":  # 8-bit head: ours with float32 rows, else fbgemm
                    kind = "q8" if q8 else "fbgemm8"
                elif mode == "int8" and q8 and child.weight.shape[1] % INT4_GROUP == 0:
                    kind = "q8"
                linear = QuantLinear(child.weight, child.bias, kind, dense, module, integer_rows)
                setattr(parent, name, linear)
    return model


def dense_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The large-batch copy: bfloat16 where the CPU computes it (AVX-512 BF16, AMX: half the
    bytes of float32, oneDNN-packed) or the model runs bfloat16 anyway; float32 elsewhere,
    where bfloat16 GEMMs are emulated: on an AVX2 CPU they ran slower than float32's."""
    if model_dtype == torch.bfloat16 or isa.native_bfloat16():
        return torch.bfloat16
    return torch.float32
