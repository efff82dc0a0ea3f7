"""Optional C++ CPU kernels (attention*.cpp, gemm.cpp, ggml_blocks.cpp, ggml_kquants.cpp,
int4.cpp, int8.cpp, kv_rows.cpp, layers.cpp, mamba.cpp, mamba2.cpp, step.cpp; their Python
bindings in bindings.cpp): one build per ISA level,
chosen at run time from cpuid (model/kernels/isa.py).

`build_kernels()` compiles them ahead of time (`cellserve build-kernels`; `make install` and
the Dockerfile's builder stage call it), one extension per level with that level's explicit
flags (never -march=native), named by level and a hash of the sources, flags and torch
version: a build made on one machine is only loaded where the CPU has its instructions, and a
stale build is never loaded. `load_kernels()` imports the best built level that the CPU runs
(CELLSERVE_ISA can force a lower one), or returns None: nothing built (it logs the command to
run, and never compiles during start-up), CELLSERVE_KERNELS=0, or a non-CPU device. Callers
then keep the torch path. The module offers
`decode_attention(q, k, v, cells, lens, scale, softcap=0)`, `prompt_attention(...)` where
`has_bf16_kernels()` (the avx512_bf16 build), the fused bfloat16 ops and `step_layers(...)`;
`LEVEL` says which build it is.

Builds go to CELLSERVE_KERNEL_DIR, by default <sys.prefix>/share/cellserve/kernels (inside the
virtual environment, so that they travel with it, as into the Docker image's final stage).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import pathlib
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from model.kernels import isa

log = logging.getLogger("cellserve.model")

# (q, k, v, cells, lens, scale, softcap): softcap > 0 caps the scores (Gemma 2), 0 does not
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float],
    torch.Tensor,
]
# (q, k, v, cells [n_kv], lens [L], scale, softcap, sinks=None, firsts=None)
PromptAttention = Callable[..., torch.Tensor]
HERE = pathlib.Path(__file__).parent
_SOURCE_NAMES = (
    "attention.cpp",
    "attention_bf16.cpp",
    "attention_f32.cpp",
    "bindings.cpp",
    "gemm.cpp",
    "ggml_blocks.cpp",
    "ggml_kquants.cpp",
    "int4.cpp",
    "int8.cpp",
    "kv_rows.cpp",
    "layers.cpp",
    "mamba.cpp",
    "mamba2.cpp",
    "step.cpp",
)
SOURCES = [HERE / name for name in _SOURCE_NAMES]
HEADERS = sorted(HERE.glob("*.h"))  # every header: a change to one rebuilds
COMMON_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-mtune=generic"]

# Each level's target flags: what its CPUs all have (model/kernels/isa.py says which CPUs).
_X86_FLAGS: dict[str, list[str]] = {
    "generic": ["-march=x86-64"],
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
}


def level_flags(level: str) -> list[str]:
    """The compiler flags of one level's build (aarch64 and others: generic, NEON baseline)."""
    if level not in isa.LEVELS:
        raise ValueError(f"ISA level {level!r} is not one of {', '.join(isa.LEVELS)}")
    target = _X86_FLAGS[level] if isa.is_x86() else []
    if not isa.is_x86() and level != "generic":
        raise ValueError(f"{level} is an x86 level; this is {platform.machine()}")
    return COMMON_FLAGS + target


def source_digest() -> str:
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def module_name(level: str) -> str:
    """cellserve_kernels_<level>_<hash of sources, flags, torch, Python, machine>."""
    h = hashlib.sha256(source_digest().encode())
    for part in (*level_flags(level), torch.__version__, sys.version, platform.machine()):
        h.update(part.encode())
    return f"cellserve_kernels_{level}_{h.hexdigest()[:12]}"


def kernel_dir() -> pathlib.Path:
    env = os.environ.get("CELLSERVE_KERNEL_DIR")
    return (
        pathlib.Path(env) if env else pathlib.Path(sys.prefix) / "share" / "cellserve" / "kernels"
    )


def library_path(level: str) -> pathlib.Path:
    return kernel_dir() / f"{module_name(level)}.so"


def levels_for_this_cpu() -> list[str]:
    """The levels worth building here: every level up to the CPU's (on x86, generic only where
    the CPU lacks AVX2: every other x86 CPU runs a better one)."""
    top = isa.LEVELS.index(isa.detected_level())
    levels = list(isa.LEVELS[1 : top + 1]) or ["generic"]
    if isa.active_level() not in levels:  # CELLSERVE_ISA=generic on an x86 CPU
        levels.insert(0, isa.active_level())
    return levels


def all_levels() -> list[str]:
    """The levels an image for any CPU of this architecture ships (`build-kernels --all`): on
    x86 those from AVX2 up (every x86 CPU since 2013-2017; older ones keep the torch path).
    CELLSERVE_KERNEL_LEVELS=a,b narrows it (a quicker build that still runs everywhere)."""
    env = os.environ.get("CELLSERVE_KERNEL_LEVELS", "").strip()
    if env:
        levels = [lv.strip() for lv in env.split(",") if lv.strip()]
        for lv in levels:
            level_flags(lv)  # ValueError for an unknown level or another architecture's
        return levels
    return list(isa.LEVELS[1:]) if isa.is_x86() else ["generic"]


def arch_levels() -> list[str]:
    """Every level that can be built for this architecture."""
    return list(isa.LEVELS) if isa.is_x86() else ["generic"]


def built_levels() -> list[str]:
    return [level for level in arch_levels() if library_path(level).is_file()]


def build_one(level: str, verbose: bool = False) -> pathlib.Path:
    """Compile one level's extension (compile only: the CPU need not run it) and move it into
    kernel_dir() atomically; returns its path. Raises on a build failure."""
    from torch.utils import cpp_extension

    name = module_name(level)
    target = library_path(level)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=target.parent) as build:
        cpp_extension._write_ninja_file_and_build_library(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=level_flags(level),
            extra_cuda_cflags=None,
            extra_sycl_cflags=None,
            extra_ldflags=None,
            extra_include_paths=None,
            build_directory=build,
            verbose=verbose,
            with_cuda=False,
            with_sycl=False,
        )
        os.replace(pathlib.Path(build) / f"{name}{cpp_extension.LIB_EXT}", target)
    return target


@dataclass(slots=True)
class BuildResult:
    level: str
    path: pathlib.Path | None
    error: str | None = None
    reused: bool = False


def build_kernels(
    levels: list[str] | None = None, verbose: bool = False, force: bool = False
) -> list[BuildResult]:
    """Build `levels` (default: levels_for_this_cpu()); a level already built is kept."""
    results = []
    for level in levels or levels_for_this_cpu():
        path = library_path(level)
        if path.is_file() and not force:
            results.append(BuildResult(level, path, reused=True))
            continue
        try:
            results.append(BuildResult(level, build_one(level, verbose)))
        except Exception as exc:  # noqa: BLE001  (reported per level: no compiler, ninja, ...)
            results.append(BuildResult(level, None, f"{type(exc).__name__}: {exc}"))
    return results


def remove_stale() -> list[pathlib.Path]:
    """Delete builds of other sources / torch versions from kernel_dir()."""
    keep = {library_path(level).name for level in arch_levels()}
    stale = [p for p in kernel_dir().glob("cellserve_kernels_*.so") if p.name not in keep]
    for p in stale:
        p.unlink(missing_ok=True)
    for p in kernel_dir().glob(".cellserve_kernels_*"):
        shutil.rmtree(p, ignore_errors=True)
    return stale


@dataclass(slots=True)
class KernelStatus:
    """What load_kernels() chose, for the start-up log, /health and /metrics."""

    level: str | None  # the build loaded; None: the torch path
    reason: str
    built: list[str]


_loaded: dict[str, Any] = {}
_status: KernelStatus | None = None


def _import(level: str) -> Any:
    key = str(library_path(level))
    if key not in _loaded:
        name = module_name(level)
        spec = importlib.util.spec_from_file_location(name, key)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {library_path(level)}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.LEVEL = level
        _loaded[key] = module
    return _loaded[key]


def choose(active: str | None = None) -> KernelStatus:
    """The build to load: the highest built level at or below the active one."""
    if os.environ.get("CELLSERVE_KERNELS", "1") == "0":
        return KernelStatus(None, "CELLSERVE_KERNELS=0", built_levels())
    active = active or isa.active_level()
    built = built_levels()
    usable = [lv for lv in built if isa.LEVELS.index(lv) <= isa.LEVELS.index(active)]
    if not usable:
        why = "none built" if not built else f"only {', '.join(built)} built"
        return KernelStatus(
            None,
            f"no C++ kernels for {active} ({why} in {kernel_dir()}; run `cellserve build-kernels`)",
            built,
        )
    level = usable[-1]
    note = "" if level == active else f" (the best built for this {active} CPU)"
    return KernelStatus(level, f"{level} build{note}", built)


def load_kernels(level: str | None = None) -> Any | None:
    """The kernels module for `level` (default: choose()), or None; never compiles."""
    global _status
    if level is not None:
        return _import(level) if library_path(level).is_file() else None
    status = choose()
    if status.level is not None:
        try:
            module = _import(status.level)
        except (ImportError, OSError) as exc:
            status = KernelStatus(
                None, f"{status.level} build failed to load ({exc})", status.built
            )
            module = None
    else:
        module = None
    if _status != status:
        (log.info if module is not None else log.warning)("C++ kernels: %s", status.reason)
        _status = status
    return module


def kernel_status() -> KernelStatus:
    """The last choice load_kernels() made (choose() if it has not run)."""
    return _status if _status is not None else choose()


def load_decode_attention() -> DecodeAttention | None:
    module = load_kernels()
    return None if module is None else module.decode_attention
