"""ModelWorker: BatchPlan -> (K-shifts, forward over the cell cache, sampling) -> StepOutput."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvcache.storage import KVStorage, rope_tables
from model.kernels import load_kernels
from model.llama import DecodeGroup, ForwardBatch, ModelArgs, PromptGroup, Transformer
from model.native import NativeDecoder
from model.sampling import sample
from model.token_mask import MaskFiller
from scheduler.plan import BatchPlan, SeqBatch, StepOutput

if TYPE_CHECKING:
    from model.loader import LoadedModel

ReadIndex = Callable[[np.ndarray], torch.Tensor | slice]  # KVStorage.read_index

# NOTE: CPU GEMM kernels (MKL, oneDNN) take shape-dependent paths for small row counts, so a
# row's result can depend on how many other rows share the matmul (~1e-5 apart). With
# batch_invariant, every forward has at least MIN_ROWS rows (padding rows read and write a
# scratch cell that no plan uses) and as many logit rows, and each sequence attends on its
# own: a sequence's logits are then bit-identical whatever else is in its batch
# (tests/reliability/test_worker_isolation.py). A decode step costs 2.2x alone, 1.1x at 16.
MIN_ROWS = 16


def set_torch_threads(n: int) -> None:
    """torch's CPU threads for the calling thread's parallel regions.

    NOTE: call it from the thread that runs the model, and keep every other thread that ran
    torch ops at 1: libgomp counts the OpenMP workers of every thread that ever opened a
    parallel region, and once they outnumber the cores it stops spin-waiting at barriers
    (GOMP's throttled spin). A 2-thread decode step run from the engine thread after a 2-thread
    model load elsewhere took 21.6 ms instead of 12.9 ms (SmolLM2 int4, 2 cores).
    """
    torch.set_num_threads(n)


def kv_bytes_per_cell(args: ModelArgs, dtype: torch.dtype) -> int:
    """K and V of one token over every layer."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * element


class ModelWorker:
    """The engine's Worker: `execute(plan) -> StepOutput`."""

    def __init__(
        self,
        model: Transformer,
        storage: KVStorage,
        batch_invariant: bool = False,
        threads: int | None = None,
        kernels: Any | None = None,
    ) -> None:
        self.model = model
        self.threads = threads
        # the C++ kernel attends each sequence over its own length, so padding costs nothing:
        # with it every decode row goes into one group (else _by_kv_length bounds the padding)
        same_dtype = storage.dtype == model.dtype
        self.decode_kernel = kernels.decode_attention if kernels and same_dtype else None
        self.native = NativeDecoder.build(model, storage, kernels)
        args = model.args
        bf16 = model.dtype == storage.dtype == torch.bfloat16
        self.prompt_kernel = (
            kernels.prompt_attention
            if kernels is not None
            and kernels.has_bf16_kernels()
            and bf16
            and args.head_dim % 32 == 0
            and args.head_dim <= 256
            and args.n_heads // args.n_kv_heads <= 16
            else None
        )
        self.fused = kernels if kernels is not None and model.dtype == torch.bfloat16 else None
        self._threads_set_in: int | None = None  # threading.get_ident() of the calling thread
        self.storage = storage
        self.batch_invariant = batch_invariant
        # the last cell is scratch for padding rows: make_worker allocates one cell more
        self.scratch_cell = storage.n_cells - 1 if batch_invariant else -1
        self.device = model.device
        self.rope = model.args.rope
        self._inv_freq = self.rope.inv_freq(self.device)
        self.masks = MaskFiller(model.args.vocab_size)

    @property
    def kv_bytes_per_cell(self) -> int:
        return self.storage.bytes_per_cell

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepOutput:
        if self.threads is not None and self._threads_set_in != threading.get_ident():
            set_torch_threads(self.threads)
            self._threads_set_in = threading.get_ident()
        masks = self.masks.start(plan.samples)  # structured outputs, beside the forward
        if any(row.embed for row in plan.samples):
            return self._execute_with_embeddings(plan, masks)
        logits = self.forward(plan)
        return sample(logits, plan.samples, None if masks is None else masks.result())

    def _execute_with_embeddings(self, plan: BatchPlan, masks: Any) -> StepOutput:
        """Embed rows return their final-norm hidden state; the others are sampled as usual.
        NOTE: logits are projected for every row (as forward does), so a sampled row's logits
        do not depend on how many embed rows share its step."""
        n = len(plan.samples)
        hidden = self.hidden(plan)  # [n_out >= n, dim]
        logits = self.model.output(hidden).float()[:n]
        sampled = [i for i, row in enumerate(plan.samples) if not row.embed]
        bits = None if masks is None else masks.result()[sampled]
        out = sample(logits[sampled], [plan.samples[i] for i in sampled], bits)
        token_ids = [-1] * n
        embeddings: list[np.ndarray | None] = [None] * n
        for i, row in enumerate(plan.samples):
            if row.embed:
                embeddings[i] = hidden[i].float().cpu().numpy()
        for j, i in enumerate(sampled):
            token_ids[i] = out.token_ids[j]
        logprobs = top = None
        if out.logprobs is not None:
            logprobs = [0.0] * n
            for j, i in enumerate(sampled):
                logprobs[i] = out.logprobs[j]
        if out.top_logprobs is not None:
            top = [[] for _ in range(n)]
            for j, i in enumerate(sampled):
                top[i] = out.top_logprobs[j]
        return StepOutput(token_ids, logprobs, top, embeddings)

    @torch.inference_mode()
    def hidden(self, plan: BatchPlan) -> torch.Tensor:
        """Apply plan.pending, run the batch -> final-norm hidden states [n_out, dim] of the
        plan's sample rows (n_out >= len(plan.samples) with batch_invariant's padding)."""
        if not plan.pending.is_empty:
            self.storage.apply(plan.pending)
        batch = self.make_batch(plan)
        native = self.native if self.native is not None and self.native.runs(batch) else None
        return self.model.hidden(batch, self.storage, None if native is None else native.layers)

    @torch.inference_mode()
    def forward(self, plan: BatchPlan) -> torch.Tensor:
        """Apply plan.pending, run the batch -> logits [len(plan.samples), vocab] float32."""
        if not plan.pending.is_empty:
            self.storage.apply(plan.pending)
        if plan.num_tokens == 0:
            return torch.zeros(0, self.model.args.vocab_size)
        batch = self.make_batch(plan)
        native = self.native if self.native is not None and self.native.runs(batch) else None
        logits = self.model(batch, self.storage, None if native is None else native.layers)
        return logits[: len(plan.samples)]

    def make_batch(self, plan: BatchPlan) -> ForwardBatch:
        dev = self.device
        positions = torch.from_numpy(np.ascontiguousarray(plan.positions, dtype=np.int64))
        cos, sin = self.rope.cos_sin(positions, self._inv_freq.cpu())
        rope_c, rope_s = rope_tables(
            cos, sin, self.model.args.head_dim, self.rope.layout, self.model.dtype
        )
        read_index = self.storage.read_index
        one_each = self.batch_invariant  # every sequence attends on its own
        decode = [] if one_each else [s for s in plan.seqs if s.end - s.start == 1]
        order = self.prompt_kernel is not None
        prompts = [
            _prompt_group(s, plan.positions[s.start : s.end], read_index, dev, order)
            for s in plan.seqs
            if one_each or s.end - s.start != 1
        ]
        n = len(plan.token_ids)
        batch = ForwardBatch(
            tokens=_tensor(plan.token_ids, dev),
            cells=_tensor(plan.cells, dev),
            rope_c=rope_c.to(dev),
            rope_s=rope_s.to(dev),
            decodes=self._decode_groups(decode, plan.positions, n),
            prompts=prompts,
            logit_rows=torch.tensor([s.row for s in plan.samples], dtype=torch.int64, device=dev),
            decode_kernel=self.decode_kernel,
            prompt_kernel=self.prompt_kernel,
            fused=self.fused,
        )
        if self.batch_invariant:
            return _pad_rows(batch, self.scratch_cell, read_index)
        return batch

    def _decode_groups(
        self, decode: list[SeqBatch], positions: np.ndarray, n_rows: int
    ) -> list[DecodeGroup]:
        """One group for the C++ kernel when every sequence attends a prefix of its cells (it
        reads each one's own length), else groups that bound the padding."""

        def group(seqs: list[SeqBatch]) -> DecodeGroup:
            return _decode_group(
                seqs, positions, n_rows, self.model.dtype, self.storage.read_index, self.device
            )

        if self.decode_kernel is not None and decode:
            one = group(decode)
            if one.lens is not None:
                return [one]
        return [group(g) for g in _by_kv_length(decode)]


def _pad_rows(batch: ForwardBatch, scratch_cell: int, read_index: ReadIndex) -> ForwardBatch:
    """At least MIN_ROWS token rows and logit rows; padding rows are token 0 at position 0,
    attending only the scratch cell they write."""
    n = batch.tokens.shape[0]
    pad = MIN_ROWS - n
    if pad > 0:
        dev = batch.tokens.device
        zeros = torch.zeros(pad, dtype=torch.int64, device=dev)
        batch.tokens = torch.cat([batch.tokens, zeros])
        batch.cells = torch.cat([batch.cells, zeros + scratch_cell])
        c, s = batch.rope_c, batch.rope_s  # padding rows rotate by 0
        batch.rope_c = torch.cat([c, torch.ones_like(c[:1]).expand(pad, -1, -1)])
        batch.rope_s = torch.cat([s, torch.zeros_like(s[:1]).expand(pad, -1, -1)])
        mask = torch.ones(pad, 1, dtype=torch.bool, device=dev)
        scratch = read_index(np.array([scratch_cell], dtype=np.int64))
        batch.prompts.append(PromptGroup(n, n + pad, scratch, mask))
    n_out = batch.logit_rows.shape[0]
    if 0 < n_out < MIN_ROWS:
        extra = batch.logit_rows[-1:].expand(MIN_ROWS - n_out)
        batch.logit_rows = torch.cat([batch.logit_rows, extra])
    return batch


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def _by_kv_length(seqs: list[SeqBatch], max_waste: float = 0.5) -> list[list[SeqBatch]]:
    """Split decode rows into groups whose padded kv wastes at most `max_waste` of the group
    (one sequence with a long context must not pad 31 short ones to its length)."""
    groups: list[list[SeqBatch]] = []
    real = 0
    for s in sorted(seqs, key=lambda s: len(s.kv_cells)):
        n = len(s.kv_cells)
        padded = (len(groups[-1]) + 1) * n if groups else 0
        if groups and padded - (real + n) <= max_waste * padded:
            groups[-1].append(s)
            real += n
        else:
            groups.append([s])
            real = n
    return groups


def _decode_group(
    seqs: list[SeqBatch],
    positions: np.ndarray,
    n_rows: int,
    dtype: torch.dtype,
    read_index: ReadIndex,
    dev: torch.device,
) -> DecodeGroup:
    n_seq = len(seqs)
    max_kv = max(len(s.kv_cells) for s in seqs)
    kv_cells = np.zeros((n_seq, max_kv), dtype=np.int64)
    mask = np.zeros((n_seq, max_kv), dtype=bool)
    for i, s in enumerate(seqs):
        n = len(s.kv_cells)
        kv_cells[i, :n] = s.kv_cells
        mask[i, :n] = s.kv_pos <= positions[s.start]
    starts = [s.start for s in seqs]
    every_row = n_seq == n_rows and starts == list(range(n_rows))
    lens = np.array([len(s.kv_cells) for s in seqs], dtype=np.int64)
    prefix = bool(np.all(mask == (np.arange(max_kv)[None, :] < lens[:, None])))
    return DecodeGroup(
        rows=None if every_row else torch.tensor(starts, dtype=torch.int64, device=dev),
        kv_index=read_index(kv_cells.reshape(-1)),
        bias=None if mask.all() else _additive(torch.from_numpy(mask), dtype, dev)[:, None],
        max_kv=max_kv,
        cells=torch.from_numpy(kv_cells).to(dev) if prefix else None,
        lens=torch.from_numpy(lens).to(dev) if prefix else None,
    )


def _additive(mask: torch.Tensor, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """bool visible -> 0 / -inf in `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf")).to(dev)


def _prompt_group(
    s: SeqBatch, q_pos: np.ndarray, read_index: ReadIndex, dev: torch.device, order: bool = False
) -> PromptGroup:
    """`order`: also the cells in position order and each row's visible count (prompt kernel)."""
    kv_pos, q_pos = np.asarray(s.kv_pos), np.asarray(q_pos)
    mask = kv_pos[None, :] <= q_pos[:, None]  # [L, n_kv]
    kv_index = read_index(np.asarray(s.kv_cells))
    group = PromptGroup(s.start, s.end, kv_index, torch.from_numpy(mask).to(dev))
    if order:
        by_pos = np.argsort(kv_pos, kind="stable")
        group.cells = _tensor(np.asarray(s.kv_cells)[by_pos], dev)
        group.lens = _tensor(np.searchsorted(kv_pos[by_pos], q_pos, side="right"), dev)
    return group


def make_worker(
    loaded: LoadedModel,
    n_cells: int,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    batch_invariant: bool = False,
    threads: int | None = None,
) -> ModelWorker:
    """A worker with a fresh KV cache of `n_cells` cells (dtype/device default to the model's);
    see MIN_ROWS for `batch_invariant`."""
    from model.loader import resolve_dtype

    model = loaded.transformer
    if device is not None and torch.device(device) != model.device:
        model = model.to(device)
    args = loaded.config
    storage = KVStorage(
        n_layers=args.n_layers,
        n_cells=n_cells + 1 if batch_invariant else n_cells,
        n_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        dtype=model.dtype if dtype is None else resolve_dtype(dtype),
        device=model.device,
        rope=args.rope,
    )
    kernels = load_kernels() if model.device.type == "cpu" else None
    return ModelWorker(model, storage, batch_invariant, threads, kernels)
