"""Which instruction-set level this process runs: detected from the CPU, capped by CELLSERVE_ISA.

Levels, lowest first (each one's CPU flags; the C++ kernels are built once per level with the
matching flags, never -march=native, so a build never runs on a CPU that lacks them):

  generic      any CPU (aarch64 NEON, x86 before Haswell): portable C++, the compiler's
               baseline vectorisation
  avx2         x86-64-v3: AVX2, FMA, F16C, BMI2 (Haswell.., Zen 1-3)
  avx512       x86-64-v4: AVX-512 F/BW/VL/DQ/CD (Skylake-SP.., Ice Lake; VNNI used by the
               libraries where present)
  avx512_bf16  avx512 + AVX-512 BF16 + VNNI (Cooper Lake, Sapphire Rapids.., Zen 4/5): the
               native bfloat16 dot products (and AMX where present: the GGUF
               K-quants' prompt chunks, ggml_kamx.h, detected at run time)

CELLSERVE_ISA=generic|avx2|avx512|avx512_bf16 forces a lower level than the CPU has (a
higher one is capped, with a warning): the kernels of that level, and the same cap on torch's
own libraries (ATen, oneDNN, MKL, fbgemm) through their environment variables, so that one
machine can run, test and measure what a smaller CPU runs. `apply_forced_isa()` must run
before torch's first CPU op (the libraries read their variables once): the `cellserve`
command, the test suite and the benchmarks call it first.
"""

from __future__ import annotations

import logging
import os
import platform
from functools import cache

log = logging.getLogger("cellserve.model")

LEVELS: tuple[str, ...] = ("generic", "avx2", "avx512", "avx512_bf16")
ENV = "CELLSERVE_ISA"

# the /proc/cpuinfo flags each x86 level needs
_NEEDS: dict[str, frozenset[str]] = {
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi2"}),
    "avx512": frozenset(
        {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
    ),
}
_NEEDS["avx512_bf16"] = _NEEDS["avx512"] | {"avx512_bf16", "avx512_vnni"}

# what each forced level sets for torch's libraries (setdefault: a user's own value wins)
_LIBRARY_ENV: dict[str, dict[str, str]] = {
    "generic": {"ATEN_CPU_CAPABILITY": "default"},
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "DNNL_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",  # no bfloat16 instructions, no AMX
        "DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI",
    },
    "avx512_bf16": {},
}


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86 / aarch64
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def detected_level(flags: frozenset[str] | None = None) -> str:
    """The highest level this CPU runs (from its flags)."""
    if flags is None:
        if not is_x86():
            return "generic"
        flags = cpu_flags()
    best = "generic"
    for level in LEVELS[1:]:
        if _NEEDS[level] <= flags:
            best = level
    return best


def forced_level() -> str | None:
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in LEVELS:
        raise ValueError(f"{ENV}={value!r} is not one of {', '.join(LEVELS)}")
    return value


def active_level() -> str:
    """The level this process runs: CELLSERVE_ISA capped at what the CPU has."""
    detected = detected_level()
    forced = forced_level()
    if forced is None:
        return detected
    if LEVELS.index(forced) > LEVELS.index(detected):
        log.warning("%s=%s: this CPU only has %s; using %s", ENV, forced, detected, detected)
        return detected
    return forced


def at_least(level: str) -> bool:
    return LEVELS.index(active_level()) >= LEVELS.index(level)


def native_bfloat16() -> bool:
    """Whether this process computes bfloat16 in hardware (AVX-512 BF16 / AMX): elsewhere
    bfloat16 math is emulated through float32 and is slower than float32 itself."""
    return at_least("avx512_bf16")


def int8_vnni() -> bool:
    """Whether fbgemm's int8 kernels run on VNNI. Without it (AVX2, AVX-512 before Cascade
    Lake) they multiply-add through vpmaddubsw, whose int16 sums saturate with full-range
    8-bit activations: the quantized linear must then use reduce_range (7-bit activations)."""
    fbgemm = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper()
    if fbgemm in ("AVX2", "AVX512", "AVX512_256"):  # capped below its VNNI kernels
        return False
    return at_least("avx512") and "avx512_vnni" in cpu_flags()


def library_env(level: str) -> dict[str, str]:
    """The environment that caps torch's own libraries at `level`."""
    if level not in LEVELS:
        raise ValueError(f"ISA level {level!r} is not one of {', '.join(LEVELS)}")
    return dict(_LIBRARY_ENV[level])


def apply_forced_isa() -> str:
    """Cap torch's libraries at CELLSERVE_ISA (when set and below the CPU's level); call before
    torch's first CPU op. Returns the active level."""
    level = active_level()
    if forced_level() is not None and level != detected_level():
        for key, value in library_env(level).items():
            os.environ.setdefault(key, value)
    return level


def describe() -> dict[str, str]:
    """For logs, /health and /metrics: the CPU, its level, the active level and why."""
    forced = forced_level()
    return {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "detected": detected_level(),
        "active": active_level(),
        "forced": forced or "",
    }
