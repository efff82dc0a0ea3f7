"""ModelWorker: BatchPlan -> (pending cache work, forward over the cells, sampling) -> output."""

from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import numpy as np
import torch

from kvcache.rope import RopeConfig, rope_tables
from kvcache.state_storage import RecurrentStorage
from kvcache.storage import GroupedKVStorage, KVStorage
from model.arch import ModelArgs
from model.kernels import isa, load_kernels
from model.layers.batch import AttnGroups, ForwardBatch
from model.layers.decoder import Transformer
from model.layers.lora import LoraSet
from model.layers.quant import QuantLinear
from model.load.dtypes import resolve_dtype
from model.runner.attn_groups import int64_tensor, pad_rows, plan_attn_groups
from model.runner.paths import LORA_STEPS, decide_paths
from model.runner.sampling import sample
from model.runner.state_batch import state_batch
from model.runner.token_mask import MaskFiller
from scheduler.plan import BatchPlan, StepOutput

log = logging.getLogger("cellserve.model")

SavedStates = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]  # slots, (conv, ssm)


def set_torch_threads(n: int) -> None:
    """torch's CPU threads for the calling thread's parallel regions.

    NOTE: call it from the thread that runs the model, and keep every other thread that ran
    torch ops at 1: libgomp counts the OpenMP workers of every thread that ever opened a
    parallel region, and once they outnumber the cores it stops spin-waiting at barriers
    (GOMP's throttled spin). A 2-thread decode step run from the engine thread after a 2-thread
    model load elsewhere took 21.6 ms instead of 12.9 ms (SmolLM2 int4, 2 cores).
    """
    torch.set_num_threads(n)


def default_cache_type(model_dtype: torch.dtype, device: str = "cpu") -> str:
    """The 16-bit cache type this machine reads fastest: bf16 where the CPU has AVX-512 BF16
    (the kernels' dot products take bf16 pairs as they are), else f16 (AVX2's F16C converts 8
    values an instruction, and f16 keeps 3 more mantissa bits); off the CPU, a bfloat16
    model's own dtype, else f16."""
    if device != "cpu":
        return "bf16" if model_dtype == torch.bfloat16 else "f16"
    return "bf16" if isa.native_bfloat16() else "f16"


def kv_bytes_per_cell(args: ModelArgs, dtype: torch.dtype) -> int:
    """K and V of one token over every layer."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * element


class ModelWorker:
    """The engine's Worker: `execute(plan) -> StepOutput`."""

    def __init__(
        self,
        model: Transformer,
        storage: KVStorage | GroupedKVStorage,
        batch_invariant: bool = False,
        threads: int | None = None,
        kernels: Any | None = None,
        lora: LoraSet | None = None,
    ) -> None:
        """`lora`: the adapters attached to `model` (model/layers/lora.py), if any."""
        self.model = model
        self.num_lora_steps = 0  # steps with LoRA rows (the Python layers)
        self.threads = threads
        # one KVStorage for every layer, or one per layer group (MemorySpec.groups order): a
        # RecurrentStorage for the recurrent group
        self.kv = storage.groups if isinstance(storage, GroupedKVStorage) else [storage]
        self.state = storage.state if isinstance(storage, GroupedKVStorage) else None
        if batch_invariant:  # one GEMM at every row count: the quantized layers' dense copies
            for m in model.modules():
                if isinstance(m, QuantLinear):
                    m.small_rows = 0
        self.paths = decide_paths(model, storage, kernels)
        self.set_lora(lora)
        args = model.args
        self._threads_set_in: int | None = None  # threading.get_ident() of the calling thread
        self.storage = storage
        self.batch_invariant = batch_invariant
        # the last cell of each pool is scratch for padding rows: make_worker adds one cell
        self.scratch = [
            s.n_cells - 1 if batch_invariant and isinstance(s, KVStorage) else -1 for s in self.kv
        ]
        self.device = model.device
        self.rope = model.args.rope
        self._inv_freq = self.rope.inv_freq(self.device)
        self.masks = MaskFiller(model.args.vocab_size)
        self.rope_swa = model.args.rope_swa
        self._inv_freq_swa = None if self.rope_swa is None else self.rope_swa.inv_freq()
        self.windows = sorted({w for w in model.args.windows if w > 0})
        self.has_attention = any(map(args.has_attention, range(args.n_layers)))

    def set_lora(self, lora: LoraSet | None) -> None:
        """The adapters attached to the model now (runtime loads: server/lora_runtime.py);
        call between steps."""
        self.lora = lora
        if lora is not None:
            self.paths.why[LORA_STEPS] = f"{len(lora)} adapters; the C++ step applies none"

    @property
    def kv_bytes_per_cell(self) -> int:
        """K and V of one token in every attention layer group."""
        return sum(s.bytes_per_cell for s in self.kv if isinstance(s, KVStorage))

    @property
    def kv_bytes_per_group(self) -> list[int]:
        """Per layer group of the model's MemorySpec: one cell's K and V bytes as stored (0 for
        the recurrent group)."""
        return [s.bytes_per_cell if isinstance(s, KVStorage) else 0 for s in self.kv]

    @property
    def kv_bytes(self) -> int:
        return sum(s.bytes_per_cell * s.n_cells for s in self.kv if isinstance(s, KVStorage))

    @property
    def state_bytes_per_slot(self) -> int:
        """One sequence's recurrent state over every recurrent layer; 0 without any."""
        return 0 if self.state is None else self.state.bytes_per_slot

    def read_rows(self, cells: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer group, copies of the K/V rows of `cells` as stored (a slot file's
        content; call between steps); of a recurrent group, its slots' (conv, ssm) states
        (RecurrentStorage.read_cells)."""
        out = []
        for storage, c in zip(self.kv, cells, strict=True):
            index = torch.from_numpy(np.asarray(c, dtype=np.int64)).to(self.device)
            k, v = storage.read_cells(index)
            out.append((k.cpu(), v.cpu()))
        return out

    def write_rows(
        self, cells: list[np.ndarray], rows: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """The inverse of read_rows (a restored slot)."""
        for storage, c, (k, v) in zip(self.kv, cells, rows, strict=True):
            index = torch.from_numpy(np.asarray(c, dtype=np.int64)).to(self.device)
            storage.write_cells(index, k.to(self.device), v.to(self.device))

    def kv_geometry(self) -> list[dict[str, object]]:
        """Per layer group, what its stored rows look like (checked before a restore)."""
        return [s.geometry() for s in self.kv]

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepOutput:
        if self.threads is not None and self._threads_set_in != threading.get_ident():
            set_torch_threads(self.threads)
            self._threads_set_in = threading.get_ident()
        plan = self._apply_pending(plan)
        saved = self._save_states(plan)
        try:
            masks = self.masks.start(plan.samples)  # structured outputs, beside the forward
            if any(row.embed for row in plan.samples):
                return self._execute_with_embeddings(plan, masks)
            logits = self.forward(plan)
            return sample(logits, plan.samples, None if masks is None else masks.result())
        except BaseException:
            if saved is not None and self.state is not None:
                self.state.restore(*saved)
            raise

    def _save_states(self, plan: BatchPlan) -> SavedStates | None:
        """A copy of the states the step's sequences start from (their pending copies applied),
        so that a step that raises leaves every slot as it was. The layers update states as
        they go, and the engine re-runs the sequences of a failing batch (scheduler/isolate.py).

        NOTE: a plan of one sequence copies nothing (12% of a Mamba2-130M-shaped decode step):
        isolate fails a lone sequence without a re-run and its slot is released uncached
        (Scheduler._finish); the step writes only its own slot (shared ones: pending copies)."""
        if self.state is None or plan.num_tokens == 0 or len(plan.seqs) < 2:
            return None
        g = next(i for i, s in enumerate(self.kv) if isinstance(s, RecurrentStorage))
        slots = torch.from_numpy(np.unique(plan.groups[g].cells)).to(self.device)
        return slots, self.state.save(slots)

    def _execute_with_embeddings(self, plan: BatchPlan, masks: Any) -> StepOutput:
        """Embed rows return their final-norm hidden state; the others are sampled as usual.
        NOTE: logits are projected for every row (as forward does), so a sampled row's logits
        do not depend on how many embed rows share its step."""
        n = len(plan.samples)
        hidden = self.hidden(plan)  # [n_out >= n, dim]
        logits = self.model.logits(hidden)[:n]
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
        """Apply each group's pending work, run the batch -> final-norm hidden states
        [n_out, dim] of the plan's sample rows (n_out >= len(plan.samples) with
        batch_invariant's padding)."""
        plan = self._apply_pending(plan)
        batch = self.make_batch(plan)
        with self._lora(batch):
            native = self.paths.native
            native = native if native is not None and native.runs(batch) else None
            layers = None if native is None else native.layers
            return self.model.hidden(batch, self.storage, layers)

    @torch.inference_mode()
    def forward(self, plan: BatchPlan) -> torch.Tensor:
        """Apply each group's pending work, run the batch -> logits [len(plan.samples), vocab]
        float32."""
        plan = self._apply_pending(plan)
        if plan.num_tokens == 0:
            return torch.zeros(0, self.model.args.vocab_size)
        batch = self.make_batch(plan)
        with self._lora(batch):
            native = self.paths.native
            layers = None if native is None or not native.runs(batch) else native.layers
            hidden = self.model.hidden(batch, self.storage, layers)
            head_ids = None if plan.head_ids is None else torch.from_numpy(plan.head_ids)
            logits = self.model.logits(hidden, head_ids)  # (a LoRA of the head applies too)
        return logits[: len(plan.samples)]

    def _lora(self, batch: ForwardBatch) -> AbstractContextManager[None]:
        """Routes the step's LoRA rows (batch.lora, set by make_batch) to their adapters; a
        step with any takes the Python layers (NativeDecoder.runs)."""
        if self.lora is None or batch.lora is None:
            return nullcontext()
        self.num_lora_steps += 1
        if self.paths.native is not None:
            log.debug("step %d with LoRA rows: the Python layers", self.num_lora_steps)
        return self.lora.active(batch.lora)

    def _apply_pending(self, plan: BatchPlan) -> BatchPlan:
        """Each group's pending work (cell copies and K-shifts, recurrent state copies) applied
        to its storage, in group order -> the plan without it (BatchPlan.without_pending).
        NOTE: the one place the worker applies pending work: once per plan, before any row
        reads the cache."""
        assert len(plan.groups) == len(self.kv), "one storage per layer group of the plan"
        if not plan.has_pending:
            return plan
        for storage, group in zip(self.kv, plan.groups, strict=True):
            if not group.pending.is_empty:
                storage.apply(group.pending)
        return plan.without_pending()

    def make_batch(self, plan: BatchPlan) -> ForwardBatch:
        dev = self.device
        positions = torch.from_numpy(np.ascontiguousarray(plan.positions, dtype=np.int64))
        if self.has_attention:
            rope_c, rope_s = self._rope_tables(positions, self.rope, self._inv_freq.cpu())
        else:  # no attention layer reads them
            rope_c = rope_s = torch.empty(len(positions), 1, 0, device=dev)
        attn = [i for i, s in enumerate(self.kv) if isinstance(s, KVStorage)]
        by_window = {plan.groups[i].window: i for i in attn}
        assert set(by_window) >= set(self.windows), "a plan group for every window"
        per_group: dict[int, AttnGroups] = {}
        for i in attn:
            storage = self.kv[i]
            assert isinstance(storage, KVStorage)
            per_group[i] = plan_attn_groups(
                plan,
                plan.groups[i],
                storage.read_index,
                self.device,
                self.model.dtype,
                one_each=self.batch_invariant,
                ordered_prompts=self.paths.prompt_attention is not None,
                one_decode_group=self.paths.decode_attention is not None,
            )
        full = per_group.get(by_window.get(0, -1), AttnGroups([], []))
        batch = ForwardBatch(
            tokens=int64_tensor(plan.token_ids, dev),
            cells=full.cells if full.cells is not None else int64_tensor(plan.groups[0].cells, dev),
            rope_c=rope_c,
            rope_s=rope_s,
            decodes=full.decodes,
            prompts=full.prompts,
            logit_rows=torch.tensor([s.row for s in plan.samples], dtype=torch.int64, device=dev),
            decode_kernel=self.paths.decode_attention,
            prompt_kernel=self.paths.prompt_attention,
            fused=self.paths.fused,
        )
        if self.lora is not None:
            batch.lora = self.lora.batch(plan.seqs, dev)
        if self.rope_swa is not None and self._inv_freq_swa is not None:
            batch.rope_swa = self._rope_tables(positions, self.rope_swa, self._inv_freq_swa)
        for w in self.windows:
            batch.windowed[w] = per_group[by_window[w]]
        if self.state is not None:
            g = next(i for i, s in enumerate(self.kv) if isinstance(s, RecurrentStorage))
            batch.state = state_batch(plan, plan.groups[g], self.batch_invariant, self.device)
        if self.batch_invariant:
            pads = {}
            for i in attn:
                storage = self.kv[i]
                assert isinstance(storage, KVStorage)
                pads[plan.groups[i].window] = (self.scratch[i], storage.read_index)
            return pad_rows(batch, pads)
        return batch

    def _rope_tables(
        self, positions: torch.Tensor, rope: RopeConfig, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope.cos_sin(positions, inv_freq)
        if rope.attn_factor != 1.0:  # LongRoPE: q and k each scaled (transformers' cos/sin too)
            cos, sin = cos * rope.attn_factor, sin * rope.attn_factor
        c, s = rope_tables(cos, sin, self.model.args.head_dim, rope.layout, self.model.dtype)
        return c.to(self.device), s.to(self.device)


class Loaded(Protocol):
    """What make_worker reads of a model.load.loader.LoadedModel."""

    @property
    def config(self) -> ModelArgs: ...

    @property
    def transformer(self) -> Transformer: ...


def make_worker(
    loaded: Loaded,
    n_cells: int,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    batch_invariant: bool = False,
    threads: int | None = None,
    group_cells: list[int] | None = None,
    lora: LoraSet | None = None,
    cache_type_k: str | None = None,
    cache_type_v: str | None = None,
) -> ModelWorker:
    """A worker with a fresh KV cache (dtype/device default to the model's); see
    model.runner.attn_groups.MIN_ROWS for `batch_invariant`. `group_cells`: per layer group of the
    model's MemorySpec, the cells of its pool (kvcache.memory.Memory.group_pools); None:
    `n_cells` for every group (the unified cache); the recurrent group's count is its state
    slots. A model with one attention group gets one KVStorage for every layer.
    `cache_type_k` / `cache_type_v`: kvcache.cache_types names (None: `dtype`'s float type);
    reads return the model's dtype."""
    model = loaded.transformer
    if device is not None and torch.device(device) != model.device:
        model = model.to(device)
    args = loaded.config
    kv_dtype = model.dtype if dtype is None else resolve_dtype(dtype)
    extra = 1 if batch_invariant else 0
    groups = args.memory_spec.groups
    cells = [n_cells] * len(groups) if group_cells is None else group_cells
    assert len(cells) == len(groups), "one cell count per layer group"

    def kv(n_layers: int, n: int, rope: RopeConfig, ropes: list[RopeConfig] | None) -> KVStorage:
        return KVStorage(
            n_layers=n_layers,
            n_cells=n + extra,
            n_kv_heads=args.n_kv_heads,
            head_dim=args.head_dim,
            dtype=model.dtype,
            device=model.device,
            rope=rope,
            layer_ropes=ropes,
            type_k=cache_type_k or kv_dtype,
            type_v=cache_type_v or kv_dtype,
        )

    storage: KVStorage | GroupedKVStorage
    if len(groups) == 1 and not args.memory_spec.has_recurrent:
        storage = kv(args.n_layers, cells[0], args.rope, args.layer_ropes)
    else:
        parts: list[KVStorage | RecurrentStorage] = []
        for g, n in zip(groups, cells, strict=True):
            if g.key == "recurrent":
                conv_shape, ssm_shape = args.state_shapes
                dt, dev = model.dtype, model.device
                parts.append(RecurrentStorage(g.layers, n, conv_shape, ssm_shape, dt, dev))
                continue
            ropes = [args.rope_of(layer) for layer in g.layers]
            parts.append(kv(len(g.layers), n, ropes[0], ropes))
        storage = GroupedKVStorage(parts, [g.layers for g in groups])
    for layer, block in enumerate(model.layers):  # kvcache/rotation.py k_center
        if (bias_k := getattr(block.mixer, "k_bias", None)) is not None:
            storage.center_k(layer, bias_k, args.n_ctx_train)
    kernels = load_kernels() if model.device.type == "cpu" else None
    return ModelWorker(model, storage, batch_invariant, threads, kernels, lora)
