"""Build the real Backend: load the model, make the worker and its KV cache, start nothing yet."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from typing import Any

from kvcache.storage import KVStorage
from scheduler.cache_tier import CacheTier
from scheduler.config import EngineConfig
from scheduler.draft import DraftModel, draft_memory
from scheduler.engine import Engine
from scheduler.speculative import SpecConfig
from scheduler.stats import StepStats
from server.backend import Backend
from server.process_memory import cache_fits, resident_bytes
from server.settings import Settings

log = logging.getLogger("cellserve.server")


def log_speculation(config: EngineConfig, memory: Any) -> None:
    spec = config.spec
    if spec.kind == "none":
        return
    rows = memory.rollback_rows
    if rows == 0:
        log.warning(
            "speculative decoding (%s) is off: this model's state (%s) rolls back only to a "
            "checkpoint, and --state-checkpoints 0 leaves no slot for the drafted rows' ones",
            spec.kind,
            type(memory).__name__,
        )
        return
    state = "" if memory.tail_rollback else f"; a recurrent state: at most {rows} in a step"
    log.info(
        "speculative decoding: %s, up to %d drafted tokens per sequence and step (min %d), "
        "only while fewer than %d sequences run or wait%s%s",
        spec.kind,
        spec.draft_max,
        spec.draft_min,
        spec.step_rows,
        f" (a draft model: at most {spec.draft_seqs_max})" if spec.uses_draft_model else "",
        state,
    )


def load_draft_model(
    settings: Settings, target: Any, device: str, threads: int, n_ctx: int
) -> DraftModel:
    """Speculative decoding's draft model (scheduler/draft.py), or ModelLoadError: opened like
    the target (the same device and runtime choices), its tokenizer checked against the
    target's, its memory from scheduler.draft.draft_memory (--n-cells cells; a recurrent or
    hybrid draft's state slots: one per seq id and its backup, --state-checkpoints beside them),
    the target's context per sequence."""
    from model.errors import ModelLoadError
    from model.layers.head import ReducedHead
    from model.load.tokenizer import check_vocab
    from model.runner.worker import make_worker
    from model.serving import fit_context, open_model

    path = settings.model_draft
    if not path:
        raise ModelLoadError("--spec-type draft needs a draft model: --model-draft PATH")
    try:
        opened = open_model(
            path, device, settings.dtype, settings.quant, head_rows=settings.draft_vocab or None
        )
        loaded = opened.loaded
        check_vocab(target.tokenizer, loaded.tokenizer)
        spec = loaded.config.memory_spec
        try:
            memory = draft_memory(
                spec, settings.n_cells, settings.n_seq_max, settings.n_batch,
                settings.state_checkpoints,
            )  # fmt: skip
        except ValueError as exc:
            raise ValueError(f"{path} cannot be a draft model: {exc}") from exc
        fit_context(loaded, n_ctx, settings.n_cells, who="the draft model's")
        worker = make_worker(
            loaded,
            settings.n_cells,
            opened.runtime.dtype,
            device,
            threads=threads if device == "cpu" else None,
            group_cells=[memory.pools[i].cells.n_cells for i in memory.group_pools],
        )
    except ValueError as exc:  # a ModelLoadError names the path itself
        raise ModelLoadError(f"--model-draft {path}: {exc}") from exc
    limit = min(target.config.vocab_size, loaded.config.vocab_size)
    head_out = loaded.transformer.output
    rows = head_out.n if isinstance(head_out, ReducedHead) else None  # (open_model's head_rows)
    draft = DraftModel(
        worker, memory, settings.n_batch, vocab_limit=limit, name=loaded.name, head_rows=rows
    )
    head = "" if rows is None else f"; its head over ids below {rows} and the sequences' own"
    log.info("draft model: %s (%s cells%s)", draft.name, settings.n_cells, head)
    return draft


def make_cache_tier(
    settings: Settings, fingerprint: str, num_fixed_loras: int | None = None
) -> CacheTier | None:
    """The prefix cache's second tier from --cache-ram / --cache-dir (None: neither);
    `num_fixed_loras`: scheduler.cache_tier.CacheTier's."""
    from kvcache.tier_store import DiskStore, RamStore

    if not settings.cache_ram and not settings.cache_dir:
        return None
    if not settings.prefix_cache:
        log.warning("--cache-ram / --cache-dir: off with --no-prefix-cache")
        return None
    stores: list[Any] = []
    if settings.cache_ram:
        stores.append(RamStore(settings.cache_ram << 20, fingerprint))
    if settings.cache_dir:
        stores.append(DiskStore(settings.cache_dir, settings.cache_dir_max_mib << 20, fingerprint))
    tier = CacheTier(
        stores, fingerprint, settings.cache_tier_min_tokens, num_fixed_loras=num_fixed_loras
    )
    for store, stats in zip(stores, tier.stats, strict=True):
        log.info(
            "prefix cache tier %s: %d MiB, %d entries found",
            store.name,
            store.max_bytes >> 20,
            stats.entries,
        )
    return tier


def load_loras(settings: Settings, loaded: Any, base_name: str) -> tuple[Any, Any]:
    """The --lora / --lora-scaled adapters attached to the loaded model: (model.layers.lora
    LoraSet for the worker, server.lora.LoraAdapters for the API), or (None, None) without
    any and without --allow-runtime-lora. ModelLoadError for an adapter that does not fit the
    base or two with one name."""
    from model.errors import ModelLoadError
    from model.layers.lora import LoraSet
    from model.load.lora import load_lora
    from server.lora import LoraAdapters, ServedAdapter

    specs = settings.lora_specs
    if not specs and not settings.allow_runtime_lora:
        return None, None
    model = loaded.transformer
    adapters = [load_lora(path, loaded.config, model.dtype, name) for name, path, _ in specs]
    names = [a.name for a in adapters]
    clash = {n for n in names if names.count(n) > 1 or n == base_name}
    if clash:
        raise ModelLoadError(
            f"LoRA adapter names must be unique and differ from the model's: {sorted(clash)} "
            "(name them with --lora NAME=PATH)"
        )
    served = []
    for i, (a, (_, _, scale)) in enumerate(zip(adapters, specs, strict=True)):
        served.append(ServedAdapter(i, a.name, a.path, scale, a.rank, a.alpha))
        log.info(
            "LoRA adapter %d %r: %s, rank %d, alpha %g, on %s, global scale %g",
            i,
            a.name,
            a.path,
            a.rank,
            a.alpha,
            ",".join(a.targets),
            scale,
        )
    return LoraSet(model, adapters), LoraAdapters(base_name, served)


def cache_ranges(worker: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(address, bytes) of a worker's K/V tensors, and of its recurrent state slots' tensors: the
    OS maps their pages in as cells are first written (kvcache/zeros.py), so the resident part is
    what server/process_memory.resident_bytes finds there."""
    from kvcache.storage import KVStorage

    def span(t: Any) -> tuple[int, int]:
        return t.data_ptr(), t.numel() * t.element_size()

    kv = [span(t) for s in worker.kv if isinstance(s, KVStorage) for t in (s.k, s.v)]
    state = [] if worker.state is None else [span(t) for t in worker.state.tensors()]
    return kv, state


def load_backend(
    settings: Settings,
    on_step: Callable[[StepStats], None],
    wrap_worker: Callable[[Any], Any] | None = None,
) -> Backend:
    """`wrap_worker` (tests only) wraps the worker the engine drives."""
    import torch

    from model.layers.ggml import weight_bytes
    from model.layers.moe import expert_load
    from model.load.encoder import is_encoder
    from model.load.fingerprint import model_fingerprint
    from model.load.packaged import resolve_model
    from model.runner.grammar import GrammarCompiler
    from model.runner.worker import default_cache_type, make_worker
    from model.serving import fit_context, open_model, resolve_device

    model, packaged_name = resolve_model(settings.model)
    if model is not None and is_encoder(model):
        from server.encoder_backend import load_encoder_backend

        return load_encoder_backend(settings, model, packaged_name, on_step, wrap_worker)
    # NOTE: load on one thread; the worker takes its threads in the engine thread (see
    # model.runner.worker.set_torch_threads: OpenMP teams opened here would slow every step).
    threads = settings.threads or os.cpu_count() or 1
    torch.set_num_threads(1)
    device = resolve_device(settings.device)
    opened = open_model(model, device, settings.dtype, settings.quant, settings.chat_template)
    loaded, dtype = opened.loaded, opened.runtime.dtype
    log.info("torch threads: %d (model steps)", threads)
    n_ctx = fit_context(loaded, settings.ctx_per_seq, settings.n_cells)
    config = EngineConfig(
        n_cells=settings.n_cells,
        n_seq_max=settings.n_seq_max,
        n_batch=settings.n_batch,
        n_ctx_seq=n_ctx,
        context_shift=settings.context_shift,
        max_queue=settings.max_queue,
        prefix_cache=settings.prefix_cache,
        prefix_index=settings.prefix_index,
        swa_index_cells=settings.swa_index_cells,
        memory_spec=loaded.config.memory_spec,
        state_checkpoints=settings.state_checkpoints,
        state_checkpoint_interval=settings.state_checkpoint_interval,
        spec=SpecConfig(settings.spec_kind, settings.draft_max, settings.draft_min),
    )
    config.validate()
    # the scheduler's memory and the worker's storage from one spec: iSWA for a model with
    # sliding-window layers (a small pool for them), else the unified cache; state slots for
    # recurrent layers (a recurrent or hybrid memory)
    memory = config.make_memory()
    for pool in memory.pools:
        unit = "state slots" if pool.kind == "slots" else f"cells (window {pool.window})"
        log.info("memory pool %s: %d %s", pool.name, pool.cells.n_cells, unit)
    log_speculation(config, memory)
    model_name = settings.served_model_name or packaged_name or loaded.name
    lora_set, loras = load_loras(settings, loaded, model_name)
    drafter = None
    if config.spec.uses_draft_model and memory.rollback_rows > 0:
        drafter = load_draft_model(settings, loaded, device, threads, n_ctx)
    type_k = settings.cache_type_k or default_cache_type(loaded.transformer.dtype, device)
    type_v = settings.cache_type_v or default_cache_type(loaded.transformer.dtype, device)
    worker = make_worker(
        loaded,
        settings.n_cells,
        dtype,
        device,
        batch_invariant=settings.batch_invariant,
        threads=threads if device == "cpu" else None,
        group_cells=[memory.pools[i].cells.n_cells for i in memory.group_pools],
        lora=lora_set,
        cache_type_k=type_k,
        cache_type_v=type_v,
    )
    # a quantized type's rows are stored Hadamard-rotated, K less a constant where it has a
    # bias (kvcache/rotation.py), unless CELLSERVE_KV_ROTATION=0: the log says which
    kv = [s for s in worker.kv if isinstance(s, KVStorage)]
    rot_k, rot_v = (kv[0].rot_k, kv[0].rot_v) if kv else (0, 0)
    centred = ", less a constant from its bias" if any(s.k_centers for s in kv) else ""
    log.info(
        "KV cache: K %s, V %s: %d bytes per cell (K and V of every layer), %.1f MiB",
        f"{type_k} (Hadamard-rotated, n={rot_k}{centred})" if rot_k else type_k,
        f"{type_v} (Hadamard-rotated, n={rot_v})" if rot_v else type_v,
        worker.kv_bytes_per_cell,
        worker.kv_bytes / 2**20,
    )
    log.info("kernel paths: %s", worker.paths.describe())
    kv_bytes = worker.kv_bytes
    if device == "cpu":
        state_total = 0 if worker.state is None else worker.state.num_bytes
        kv_ranges, state_ranges = cache_ranges(worker)
        warning = cache_fits(kv_bytes + state_total, resident_bytes(kv_ranges + state_ranges))
        if warning:
            log.warning(warning)
    mapped, owned = weight_bytes(loaded.transformer)
    real_worker = worker
    if wrap_worker is not None:
        worker = wrap_worker(worker)
    # slot files and the disk tier name adapters by index: the adapters are part of the identity
    adapter_paths = [a.path for a in loras.adapters] if loras is not None else []
    fingerprint = model_fingerprint(loaded.path, *adapter_paths)
    tier = make_cache_tier(settings, fingerprint, len(adapter_paths))
    engine = Engine(worker, config, on_step=on_step, memory=memory, drafter=drafter, tier=tier)
    lora_runtime = None
    if settings.allow_runtime_lora and loras is not None:
        from server.lora_runtime import LoraRuntime

        lora_runtime = LoraRuntime(loras, engine, real_worker, loaded.config)
    return Backend(
        engine=engine,
        tokenizer=loaded.tokenizer,
        chat_template=loaded.chat_template,
        model_name=model_name,
        n_ctx_seq=n_ctx,
        n_cells=settings.n_cells,
        cache_bytes=kv_bytes,
        cache_bytes_per_cell=worker.kv_bytes_per_cell,
        state_bytes=0 if real_worker.state is None else real_worker.state.num_bytes,
        cache_ranges=partial(cache_ranges, real_worker) if device == "cpu" else None,
        embedding_dim=loaded.config.dim,
        grammars=GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size),
        runtime={
            "device": device,
            "isa": opened.isa,
            "cpu_isa": opened.cpu_isa,
            "kernels": opened.kernels,
            "native_step": "yes" if worker.paths.native is not None else "no",
            "dtype": dtype,
            "cache_type_k": type_k,
            "cache_type_v": type_v,
            "quant": opened.runtime.quant,
        },
        weights_mapped_bytes=mapped,
        weights_owned_bytes=owned,
        expert_load=(
            partial(expert_load, loaded.transformer) if loaded.config.moe is not None else None
        ),
        model_fingerprint=fingerprint,
        loras=loras,
        lora_runtime=lora_runtime,
    )
