"""Where the process's memory goes (logged at start-up, exported by server/metrics.py as
cellserve_memory_bytes): the weights mapped from the model file, the weights, the KV cache and
the recurrent state slots in process memory, and the rest."""

from __future__ import annotations

from dataclasses import dataclass


def process_memory() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of this process in bytes (/proc/self/status; {} elsewhere)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


@dataclass(slots=True)
class MemoryParts:
    weights_mapped: int = 0  # bytes of weights that are views of the model file's mapping
    weights_owned: int = 0  # bytes of weights in process memory
    kv_cache: int = 0
    state_slots: int = 0  # a recurrent or hybrid model's state slots


def memory_breakdown(parts: MemoryParts) -> dict[str, int]:
    """Where the process's memory goes: the weights mapped from the file (their size, and the
    resident file pages, mostly theirs), the weights, the KV cache and the recurrent state slots
    in process memory, the rest of the anonymous memory (activations, Python, torch), and the
    total RSS."""
    proc = process_memory()
    anon = proc.get("RssAnon", 0)
    return {
        "weights_mapped": parts.weights_mapped,
        "weights_mapped_resident": proc.get("RssFile", 0),
        "weights_owned": parts.weights_owned,
        "kv_cache": parts.kv_cache,
        "state_slots": parts.state_slots,
        "other": max(0, anon - parts.weights_owned - parts.kv_cache - parts.state_slots),
        "rss": proc.get("VmRSS", 0),
    }
